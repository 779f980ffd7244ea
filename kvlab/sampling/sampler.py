"""Choosing the next token from logits: greedy, or seeded sampling with temperature/top-k/top-p/min-p.

Parameter names and meanings follow vLLM's SamplingParams: temperature 0 is greedy; top_k 0 or -1 is
off; top_p 1.0 is off; min_p 0.0 is off; seed None or -1 (llama.cpp's spelling) draws a fresh seed.
The engine's fields (n, max_tokens, stop_token_ids, stop, ignore_eos, logprobs) come after the first
five, which `generate` passes positionally. `grammar` (a CompiledGrammar, kvlab/sampling/grammar.py)
constrains every draw: each sampler owns its sequence's matcher, masks the logits before the draw and feeds
the chosen token to the matcher after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvlab import validate
from kvlab.errors import InputError
from kvlab.sampling.grammar import CompiledGrammar, GrammarMatcher, mask_logits

# Below this, logits / temperature overflows float64 for logits of ordinary size; vLLM treats temperatures
# under 1e-5 as greedy, we refuse them so the user knows which one they got.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: CompiledGrammar | None = None

    def __post_init__(self) -> None:
        # One checker per kind of value (kvlab.validate), shared with the CLI and the server. Each field is
        # stored back in its canonical type, so equal settings compare and print equal.
        temperature = validate.finite_float(self.temperature, "temperature", low=0.0)
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise InputError(f"temperature {temperature!r} is too small to sample with (logits / temperature "
                             f"overflows): use 0 for greedy, or >= {MIN_TEMPERATURE}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", validate.int_in_range(self.top_k, "top_k (0 or -1 = off)", -1))
        object.__setattr__(self, "top_p", validate.finite_float(self.top_p, "top_p", low=0.0, high=1.0,
                                                                low_open=True))
        object.__setattr__(self, "min_p", validate.finite_float(self.min_p, "min_p", low=0.0, high=1.0))
        object.__setattr__(self, "seed", validate.seed(self.seed))
        self._check_engine_fields()

    def _check_engine_fields(self) -> None:
        """Validate (and normalise to tuples) the fields the engine reads."""
        if not validate.is_int(self.n) or self.n < 1:
            raise InputError(f"n must be an int >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not validate.is_int(self.max_tokens) or self.max_tokens < 1):
            raise InputError(f"max_tokens must be an int >= 1 or None (to EOS or the context end), "
                             f"got {self.max_tokens!r}")
        if self.logprobs is not None and (not validate.is_int(self.logprobs) or self.logprobs < 0):
            raise InputError(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        ids = _as_tuple(self.stop_token_ids, "stop_token_ids")
        if not all(validate.is_int(i) and i >= 0 for i in ids):
            raise InputError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop")
        if not all(isinstance(s, str) and s for s in stop):
            raise InputError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        object.__setattr__(self, "stop", stop)
        self._check_grammar()

    def _check_grammar(self) -> None:
        """A grammar's answer ends only at the EOS, when the grammar accepts: anything else that could end
        it early would return a cut answer as finished ("stop")."""
        if self.grammar is None:
            return
        if not isinstance(self.grammar, CompiledGrammar):
            raise InputError(f"grammar must be a CompiledGrammar (kvlab.sampling.grammar.compile_grammar), "
                             f"got {type(self.grammar).__name__}")
        if self.ignore_eos:
            raise InputError("ignore_eos cannot be combined with structured output: the answer ends at the "
                             "end-of-sequence token the grammar allows once it is complete")
        if self.stop or self.stop_token_ids:
            raise InputError("stop strings and stop_token_ids cannot be combined with structured output: an "
                             "answer cut there would not match the grammar")

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` of n: seed + index (vLLM), so samples differ but reproduce."""
        return self if self.seed is None or index == 0 else replace(self, seed=self.seed + index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_tuple(value: Any, name: str) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"{name} must be a list, got {value!r}")
    return tuple(value)


def log_probs(logits: np.ndarray) -> np.ndarray:
    """The log-softmax of one row of logits, in float64: what the engine reports as logprobs (and what
    `kvlab verify` recomputes, so equal logits give equal logprobs)."""
    row = np.asarray(logits, dtype=np.float64)
    shifted = row - row.max()
    return shifted - math.log(np.exp(shifted).sum())


def top_logprobs(logits: np.ndarray, token_id: int, k: int) -> dict[int, float]:
    """{token: logprob} of the model's distribution (before sampling filters) for the k most likely
    tokens plus the chosen one, as vLLM's `logprobs=k` returns them."""
    logp = log_probs(logits)
    ids = np.argsort(-logp, kind="stable")[:k] if k else np.array([], dtype=np.int64)
    return {int(i): float(logp[i]) for i in (*ids.tolist(), int(token_id))}


class Sampler:
    """Turns [B, vocab] logits into [B] token ids; owns the seeded generator so runs are reproducible."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.matchers: list[GrammarMatcher] = []  # one per row, made at the first call (params.grammar)

    def row_matchers(self, rows: int) -> list[GrammarMatcher | None]:
        """The grammar matcher of each of `rows` rows (None without a grammar)."""
        if self.params.grammar is None:
            return [None] * rows
        while len(self.matchers) < rows:
            self.matchers.append(self.params.grammar.matcher())
        return list(self.matchers[:rows])

    def accept(self, tokens: np.ndarray) -> None:
        """Feed each row's chosen token to its matcher (rows whose matcher is done are padding)."""
        for matcher, token in zip(self.matchers, np.asarray(tokens).reshape(-1).tolist()):
            if not matcher.done and matcher.error is None:
                matcher.advance(token)

    @property
    def failure(self) -> str | None:
        """Why a row's grammar matcher failed (a forbidden token or a step past its limits), or None: a
        sequence with a failure must not be reported as a finished answer."""
        return next((m.error for m in self.matchers if m.error is not None), None)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampled from, after temperature and the top-k/top-p/min-p filters."""
        p = self.params
        scaled = np.asarray(logits, dtype=np.float64) / p.temperature
        if p.top_k > 0 and p.top_k < scaled.shape[-1]:
            kth = np.partition(scaled, -p.top_k, axis=-1)[:, -p.top_k][:, None]
            scaled = np.where(scaled >= kth, scaled, -np.inf)
        probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        if p.top_p < 1.0:
            order = np.argsort(-probs, axis=-1, kind="stable")
            sorted_probs = np.take_along_axis(probs, order, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
            drop_sorted = (np.cumsum(sorted_probs, axis=-1) - sorted_probs) >= p.top_p
            drop = np.zeros_like(drop_sorted)
            np.put_along_axis(drop, order, drop_sorted, axis=-1)
            probs = np.where(drop, 0.0, probs)
        if p.min_p > 0.0:
            probs = np.where(probs >= p.min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        return probs / probs.sum(axis=-1, keepdims=True)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """Token ids [B] for logits [B, vocab]: masked by the grammar, drawn, then fed to the matchers."""
        logits = mask_logits(logits, self.row_matchers(logits.shape[0]))
        tokens = self.draw(logits)
        self.accept(tokens)
        return tokens

    def draw(self, logits: np.ndarray) -> np.ndarray:
        """Token ids from logits as they are (no grammar)."""
        if self.params.greedy:
            return np.argmax(logits, axis=-1).astype(np.int64)
        probs = self.probabilities(logits)
        u = self.rng.random((probs.shape[0], 1))
        choice = (np.cumsum(probs, axis=-1) < u).sum(axis=-1)
        return np.minimum(choice, probs.shape[-1] - 1).astype(np.int64)


def sample_rows(samplers: list[Sampler], logits: np.ndarray) -> np.ndarray:
    """One token per row of [R, vocab] `logits`, row i drawn by `samplers[i]`: the greedy rows in one argmax
    over them all; each seeded row by its own generator, so a request's tokens do not depend on who shares
    its step. Grammar rows are masked first (their masks filled together), and their matchers advanced after."""
    tokens = np.empty(len(samplers), dtype=np.int64)
    logits = mask_logits(logits, [sampler.row_matchers(1)[0] for sampler in samplers])
    greedy = [i for i, sampler in enumerate(samplers) if sampler.params.greedy]
    if greedy:
        tokens[greedy] = np.argmax(logits[greedy], axis=-1)
    for i, sampler in enumerate(samplers):
        if not sampler.params.greedy:
            tokens[i] = sampler.draw(logits[i:i + 1])[0]
        sampler.accept(tokens[i:i + 1])
    return tokens
