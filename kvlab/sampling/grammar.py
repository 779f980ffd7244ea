"""Structured output: a grammar (JSON schema, regex, choice, GBNF/Lark) as a token mask per sequence and step.

Why a mask: the only exact way to make a model's answer match a schema is to forbid, before each draw, every
token that cannot continue it (vLLM, llama.cpp and SGLang all do this). The grammar engine is llguidance
(an abi3 wheel without dependencies): it compiles the grammar against the vocabulary's token bytes and
tells, per step, which tokens may come next; the end-of-sequence token is allowed exactly when the grammar
accepts what was generated. Three pieces, each used where it belongs:

- `GrammarSpec`: what the user asked for, in canonical text (schemas with sorted keys), so equal requests
  compile once. `check()` validates it without a vocabulary (the CLI does this before loading a model).
- `compile_grammar(spec, vocab)`: the spec compiled for one `GrammarVocab` (the tokenizer's token bytes and
  EOS ids), cached by content in an LRU. Bad or too costly grammars raise InputError naming the problem;
  `LIMITS` makes a pathological one fail in milliseconds, not at some later step.
- `GrammarMatcher`: one sequence's parse state (a cheap copy of the compiled template): `fill_mask(bitmask,
  row)`, `advance(token)`, `rollback(n)`, `is_accepting()`. `mask_logits` applies the masks of a batch of
  rows; the Sampler (kvlab/sampling/sampler.py) owns a sequence's matcher, as it owns its random generator,
  so the mask is part of the sampler's input and identical in every schedule.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from kvlab.errors import InputError

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar text longer than this is refused before compiling
CACHE_SIZE = 64                  # compiled grammars kept (LRU), per process
# llguidance's resource limits, tighter than its defaults (fuel 1M / 200k, 500k grammar symbols, 250k lexer states):
# a grammar past them is refused in a few milliseconds with llguidance's message, before any engine work.
LIMIT_VALUES = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                    step_max_items=50_000, max_lexer_states=50_000, max_grammar_size=30_000,
                    verbose_errors=False)
# llguidance builds a grammar recursively: a 3,000-rule chain overflowed an 8 MiB thread stack (a crash, not an
# error). Grammars are built on one thread with this stack, where the longest chain MAX_GRAMMAR_CHARS holds builds.
COMPILE_STACK_BYTES = 256 << 20
# JSON as compact as json.dumps(separators=(",", ":")): whitespace a small model could loop on is not allowed
JSON_OPTIONS = {"whitespace_flexible": False}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a core dependency; only a broken install lacks it
        raise InputError("structured output needs the llguidance package (pip install llguidance)") from exc
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as the user gave it: `kind` (one of GRAMMAR_KINDS) and its canonical `text`."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InputError(f"unknown grammar kind {self.kind!r}: expected one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.text, str):
            raise InputError(f"the {self.kind} must be text, got {type(self.text).__name__}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InputError(f"the {self.kind} is {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS} "
                             "are compiled")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> "GrammarSpec":
        """A JSON schema (a dict, or its JSON text); `True` / `{}` accept any JSON value."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InputError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        if not isinstance(pattern, str) or not pattern:
            raise InputError(f"a regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "GrammarSpec":
        """Exactly one of `choices` (vLLM's `choice`)."""
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices or \
                not all(isinstance(c, str) and c for c in choices):
            raise InputError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(list(choices), separators=(",", ":")))

    @classmethod
    def grammar(cls, text: str) -> "GrammarSpec":
        """A llama.cpp GBNF grammar (`root ::= ...`) or a Lark grammar (`start: ...`)."""
        if not isinstance(text, str) or not text.strip():
            raise InputError("a grammar must be non-empty GBNF or Lark text")
        return cls("grammar", text)

    def llguidance_grammar(self) -> str:
        """The spec as llguidance's grammar text; InputError for a schema or grammar it cannot read."""
        llg = _llg()
        try:
            if self.kind in ("json_schema", "json_object"):
                schema = self.text if self.kind == "json_schema" else '{"type":"object"}'
                return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "choice":
                return llg.grammar_from("choice", self.text)
            return llg.grammar_from("gbnf", self.text)  # Lark passes through; GBNF is converted
        except Exception as exc:  # llguidance raises ValueError/Exception with a readable message
            raise InputError(f"invalid {self.label}: {exc}") from None

    @property
    def label(self) -> str:
        return {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[self.kind]

    def check(self) -> None:
        """Validate without a vocabulary (before a model is loaded): InputError naming the problem."""
        llg = _llg()
        grammar = self.llguidance_grammar()
        message = _on_compile_thread(lambda: llg.LLMatcher.validate_grammar(grammar, None, limits=_limits()))
        if message:
            raise InputError(f"invalid {self.label}: {_first_lines(message)}")


_COMPILER: ThreadPoolExecutor | None = None
_COMPILER_LOCK = threading.Lock()


def _on_compile_thread(fn: Any) -> Any:
    """`fn()` on the grammar-building thread (a deep stack, see COMPILE_STACK_BYTES); its result or error."""
    global _COMPILER
    with _COMPILER_LOCK:
        if _COMPILER is None:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:  # the stack size applies to threads started now: start the pool's one thread at once
                _COMPILER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-grammar")
                _COMPILER.submit(lambda: None).result()
            finally:
                threading.stack_size(previous)
    return _COMPILER.submit(fn).result()


def _limits() -> Any:
    return _llg().LLParserLimits(**LIMIT_VALUES)


def _first_lines(message: str, lines: int = 6) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:lines] if line.strip())


# --- the vocabulary ---------------------------------------------------------------------------------------------
class GrammarVocab:
    """The vocabulary llguidance matches against: every token's bytes, the logits' width and the EOS ids.

    Built from an HF `tokenizers` tokenizer (kvlab's HFTokenizer, also what a GGUF file's vocabulary becomes)
    by its tokenizer.json, or from any tokenizer with `token_bytes(id)`/byte ids (the byte tokenizer).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        llg = _llg()
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(sorted({int(i) for i in eos_ids}))
        if not self.eos_ids:
            raise InputError("structured output needs an end-of-sequence token id; this tokenizer has none")
        backend = getattr(tokenizer, "tokenizer", None)
        if backend is not None and hasattr(backend, "to_str"):
            self.ll = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=list(self.eos_ids))
        else:
            self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer, self.vocab_size, self.eos_ids)),
                                      n_vocab=self.vocab_size, eos_token=list(self.eos_ids))
        self.key = (id(self), self.vocab_size, self.eos_ids)


class _ByteVocab:
    """TokenizerWrapper's view of a byte-level tokenizer (ids 0-255 are bytes; the rest special)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = [bytes([i]) if i < 256 else b"\xff<special_%d>" % i for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_VOCABS: "weakref.WeakKeyDictionary[Any, dict[tuple, GrammarVocab]]" = weakref.WeakKeyDictionary()
_VOCAB_LOCK = threading.Lock()


def grammar_vocab(tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> GrammarVocab:
    """The GrammarVocab of `tokenizer` (built once per tokenizer, vocab size and EOS ids)."""
    key = (int(vocab_size), tuple(sorted({int(i) for i in eos_ids})))
    with _VOCAB_LOCK:
        known = _VOCABS.setdefault(tokenizer, {})
        if key not in known:
            known[key] = GrammarVocab(tokenizer, *key)
        return known[key]


# --- compiling -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one vocabulary: a matcher template that `matcher()` copies per sequence."""

    spec: GrammarSpec
    vocab: GrammarVocab
    template: Any  # llguidance.LLMatcher in its start state

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.vocab.eos_ids

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self.template.deep_copy(), self.vocab_size, self.eos_ids)


class GrammarCache:
    """Compiled grammars by (vocabulary, kind, canonical text), least recently used dropped first."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, spec: GrammarSpec, vocab: GrammarVocab) -> CompiledGrammar:
        key = (vocab.key, spec.kind, spec.text)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
        compiled = _compile(spec, vocab)  # outside the lock: llguidance releases the GIL while it builds
        with self._lock:
            self.misses += 1
            self._items[key] = compiled
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return compiled


def _compile(spec: GrammarSpec, vocab: GrammarVocab) -> CompiledGrammar:
    llg = _llg()
    grammar = spec.llguidance_grammar()
    template = _on_compile_thread(lambda: llg.LLMatcher(vocab.ll, grammar, log_level=0, limits=_limits()))
    if template.is_error():
        raise InputError(f"invalid {spec.label}: {_first_lines(template.get_error())}")
    return CompiledGrammar(spec, vocab, template)


GRAMMAR_CACHE = GrammarCache()


def compile_grammar(spec: GrammarSpec, vocab: GrammarVocab) -> CompiledGrammar:
    """`spec` compiled for `vocab`, from the process's LRU when the same text was compiled before."""
    return GRAMMAR_CACHE.get(spec, vocab)


# --- one sequence's state -------------------------------------------------------------------------------------
class GrammarMatcher:
    """The parse state of one sequence: which tokens may come next, and the tokens consumed so far."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.ended = False  # an EOS was consumed: the answer is over (llguidance's is_stopped() turns true
        #                     earlier, once nothing but the EOS may follow)

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed tokens of the next step into `bitmask[row]` (int32 words, bit i = token i)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    def advance(self, token: int) -> bool:
        """Consume the sampled `token`; False (and an error state) if the grammar forbids it."""
        ok = bool(self._m.consume_token(int(token)))
        self.ended = ok and int(token) in self.eos_ids
        return ok

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` tokens (speculative decoding's rejected drafts)."""
        self.ended = self.ended and num_tokens == 0
        return bool(self._m.rollback(int(num_tokens)))

    def is_accepting(self) -> bool:
        """The tokens so far are a complete answer: the EOS is allowed now."""
        return bool(self._m.is_accepting())

    @property
    def done(self) -> bool:
        """EOS consumed: nothing more to mask (a row of padding). A failed matcher is not done: its mask
        allows only the EOS."""
        return self.ended

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a forbidden token, a step past the limits), or None."""
        return _first_lines(self._m.get_error()) if self._m.is_error() else None


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """[rows, ceil(vocab / 32)] int32 words, every token allowed."""
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


_EXECUTOR: Any = None


def _fill_masks(live: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """Fill the rows of several matchers at once: llguidance's thread pool, without the GIL, for a batch."""
    global _EXECUTOR
    if len(live) == 1:
        live[0][0].fill_mask(bitmask, live[0][1])
        return
    from llguidance import LLExecutor
    from llguidance.numpy import fill_next_token_bitmask_par

    if _EXECUTOR is None:
        _EXECUTOR = LLExecutor()
    fill_next_token_bitmask_par(_EXECUTOR, [(m._m, row) for m, row in live], bitmask)


def mask_logits(logits: np.ndarray, matchers: Sequence[GrammarMatcher | None]) -> np.ndarray:
    """`logits` [R, vocab] with every token row i's matcher forbids set to -inf (a copy; rows without a
    live matcher unchanged). The mask depends only on the matcher's consumed tokens, never on the batch."""
    live = [(m, row) for row, m in enumerate(matchers) if m is not None and not m.done]
    if not live:
        return logits
    vocab = logits.shape[-1]
    for m, _ in live:
        if m.vocab_size != vocab:
            raise InputError(f"the grammar was compiled for a vocabulary of {m.vocab_size} tokens but the "
                             f"model's logits have {vocab}")
    bitmask = allocate_bitmask(len(matchers), vocab)
    # Not overlapped with the forward (as vLLM overlaps xgrammar), measured (bench/bench_structured.py, SmolLM2-
    # 135M Q4_1, a free-string schema): the fill, the only part that could run while the forward does, is
    # ~0.015 ms a row, 0.15 % of a 9.4 ms batch-1 step; the rest is applying the mask, which needs the logits.
    _fill_masks(live, bitmask)
    rows = [row for _, row in live]
    allowed = np.unpackbits(bitmask[rows].view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(bool)
    out = np.array(logits, copy=True)
    out[rows] = np.where(allowed, out[rows], np.asarray(-np.inf, dtype=out.dtype))  # a choice, no arithmetic
    return out
