"""`--speculative-config` for `kvlab generate` and `kvlab chat`: the same commands, run through the Engine.

Speculative decoding lives in the engine (kvlab/engine/speculative.py: guesses verified in one forward, the
rows committed only where plain decoding agrees), so with the flag the CLI builds an Engine for the model,
adds one request per completion or chat turn and prints the text of each RequestOutput as it arrives. The
text is plain decoding's, token for token: each emitted token is the one drawn from the target's row, one
draw per token in order, guess or no guess. Without the flag the commands keep their contiguous-cache path.
A bad config exits 2 naming its field before any model is loaded (SpeculativeConfig.parse only reads JSON
and checks that a draft model's path exists; the Engine loads the draft).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvlab.cli.checks import drawn_seed_note
from kvlab.cli.fmt import human_bytes, prompt_tokens_text
from kvlab.engine.engine import Engine
from kvlab.engine.request import RequestOutput
from kvlab.engine.speculative import SpeculativeConfig
from kvlab.errors import ConfigError, InputError
from kvlab.kernels import CompileCounter
from kvlab.sampling.sampler import SamplingParams

FLAG_HELP = ("speculative decoding as vLLM spells it, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}' "
             "(prompt lookup; also prompt_lookup_max/prompt_lookup_min) or '{\"method\": \"draft_model\", "
             "\"model\": PATH, \"num_speculative_tokens\": 3}'; runs through the engine, same text as without")


def add_speculative_flag(parser: argparse.ArgumentParser) -> None:
    """--speculative-config JSON (--speculative_config too: the CLI accepts either spelling of any flag)."""
    parser.add_argument("--speculative-config", dest="speculative_config", metavar="JSON", default=None,
                        help=FLAG_HELP)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The parsed flag, or None; ConfigError (exit 2) naming the field, before anything is loaded."""
    spec = getattr(args, "speculative_config", None)
    if spec is None:
        return None
    try:
        parsed = SpeculativeConfig.parse(spec)
    except ConfigError as exc:
        raise ConfigError(f"--speculative-config: {exc}") from None
    refuse_plain_only_flags(args)
    return parsed


# --- counting what speculation did ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecCounts:
    """Guesses made and kept (engine counters, or one sequence's)."""

    drafted: int
    accepted: int

    def __sub__(self, other: "SpecCounts") -> "SpecCounts":
        return SpecCounts(self.drafted - other.drafted, self.accepted - other.accepted)

    def text(self) -> str:
        rate = f"{100 * self.accepted / self.drafted:.0f} %" if self.drafted else "-"
        return f"drafted {self.drafted}, accepted {self.accepted} ({rate})"


def spec_counts(engine: Engine) -> SpecCounts:
    stats = engine.stats()
    return SpecCounts(stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"])


# --- one request, streamed ----------------------------------------------------------------------------------
def stream_request(engine: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams,
                   on_token: Callable[[int], None]) -> RequestOutput:
    """Add one request and step the engine until it finishes, calling `on_token` for each new token as its
    step reports it (a step that kept k guesses reports k + 1). Ctrl-C aborts the request (its blocks go
    back to the pool) and propagates."""
    engine.add_request(request_id, list(prompt), params)
    seen, last = 0, None
    try:
        while last is None or not last.finished:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                last = output
                tokens = output.outputs[0].token_ids
                for token in tokens[seen:]:
                    on_token(int(token))
                seen = len(tokens)
    except KeyboardInterrupt:
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)
            engine.step()
        raise
    return last


def warm_up(engine: Engine, first_token: int) -> float:
    """Compile (first run) or load the paged and verification kernels with a throwaway repeating request,
    so the timed prefill and decode are their own; seconds spent if numba compiled anything, else 0."""
    start = time.perf_counter()
    with CompileCounter() as compiled:  # twice: the second run starts from a prefix-cache hit
        for _ in range(2):
            engine.generate([[first_token] * 20], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.reset_prefix_cache()
    return time.perf_counter() - start if compiled.count else 0.0


def engine_for_one(model: Any, tokenizer: Any, spec: SpeculativeConfig, kv_dtype: Any, tokens: int,
                   policy: str | None = None, prefix_caching: bool = False) -> Engine:
    """An engine for one sequence at a time: a pool for `tokens` plus the guesses' rows (a cache policy
    sizes its own)."""
    tokens = max(tokens, 24)  # and the warm-up's
    blocks = None if policy is not None else -(-(tokens + spec.num_speculative_tokens + 1) // 16) + 1
    return Engine(model, tokenizer, speculative_config=spec, max_num_seqs=1, kv_cache_dtype=kv_dtype,
                  num_blocks=blocks, block_size=16, kv_policy=policy, enable_prefix_caching=prefix_caching)


def stop_words(finish_reason: str | None, num_new: int, max_tokens: int) -> str:
    """The engine's finish reason in the plain path's words (StopReason values)."""
    if finish_reason == "stop":
        return "eos"
    if finish_reason == "length":
        return "max tokens" if num_new >= max_tokens else "context full"
    return finish_reason or "abort"


# --- kvlab generate ------------------------------------------------------------------------------------------
def refuse_plain_only_flags(args: argparse.Namespace) -> None:
    """Flags of the contiguous path the engine does not take (checked before loading)."""
    if getattr(args, "prompt_cache", None):
        raise InputError("--prompt-cache cannot be combined with --speculative-config (the prompt cache is a "
                         "contiguous session file; the engine keeps its own prefix cache)")
    if getattr(args, "context_shift", False):
        raise InputError("--context-shift cannot be combined with --speculative-config: use --cache-policy "
                         "shift:KEEP[:BUDGET], which the engine runs")


def generate_with_engine(args: argparse.Namespace, model: Any, tokenizer: Any, text: str, prompt: list[int],
                         spec: SpeculativeConfig, resolved: Any, seed_drawn: bool) -> int:
    """`kvlab generate` through the Engine: echo the prompt, stream the completion, one stats line."""
    from kvlab.cli.generate import check_prompt, open_stream, stop_token_ids
    from kvlab.cli.sampling_flags import compiled_grammar

    context = model.config.max_position_embeddings
    policy = args.cache_policy
    check_prompt(prompt, context, policy)
    stop = [] if args.ignore_eos else stop_token_ids(model, tokenizer)
    room = context - len(prompt)
    if policy is None and room < 1:
        from kvlab.errors import ContextLengthError
        raise ContextLengthError(f"the prompt is {len(prompt)} tokens: no room left in the model's context of "
                                 f"{context} tokens")
    wanted = None if args.max_tokens == -1 else args.max_tokens
    max_tokens = (wanted if wanted is not None else 1 << 30) if policy is not None else \
        min(wanted if wanted is not None else room, room)
    engine = engine_for_one(model, tokenizer, spec, args.kv_dtype, len(prompt) + max_tokens
                            if policy is None else 0, policy)
    compile_seconds = warm_up(engine, prompt[0])
    params = SamplingParams(**resolved.values, seed=args.seed, max_tokens=max_tokens, ignore_eos=args.ignore_eos,
                            stop_token_ids=tuple(stop),
                            grammar=compiled_grammar(args, tokenizer, model.config.vocab_size, stop))
    stream = open_stream(args, tokenizer, text, prompt, stop, resolved, seed_drawn)
    before = spec_counts(engine)
    stream.start()
    try:
        out = stream_request(engine, "generate", prompt, params, stream.on_token)
        reason = stop_words(out.outputs[0].finish_reason, len(stream.tokens), max_tokens)
        computed = len(prompt) - out.num_cached_tokens
    except KeyboardInterrupt:
        computed, reason = len(prompt), "interrupted"
    stream.finish()
    line = engine_stats_line(stream, engine, len(prompt), computed, reason, spec_counts(engine) - before,
                             compile_seconds)
    print(line + f" | sampling: {resolved.summary()}"
          + (f" | {drawn_seed_note(args.seed)}" if seed_drawn else ""), file=sys.stderr, flush=True)
    return 130 if reason == "interrupted" else 0


def engine_stats_line(stream: Any, engine: Engine, prompt_tokens: int, computed: int, reason: str,
                      counts: SpecCounts, compile_seconds: float) -> str:
    """generate's stats line (`decode N tokens, X ms/token`) with `drafted D, accepted A (R %)` after the
    decode figures; the cache is the engine's rows for this sequence."""
    from kvlab.cli.generate import GenerationStats

    first, last = stream.first_token_at, stream.last_token_at
    tokens = prompt_tokens + max(len(stream.tokens) - 1, 0)  # the last token's K/V is never computed
    pool = engine.block_pool
    stats = GenerationStats(
        prompt_tokens=prompt_tokens, computed_prompt_tokens=computed,
        prefill_seconds=(first - stream.started) if stream.tokens else 0.0, new_tokens=len(stream.tokens),
        decode_seconds=last - first, cache_tokens=tokens,
        cache_bytes=tokens * pool.bytes_per_block // pool.block_size,
        cache_dtype=str(getattr(engine.kv_cache_dtype, "name", engine.kv_cache_dtype)), stop_reason=reason,
        compile_seconds=compile_seconds)
    parts = stats.line().split(" | ")
    at = next(i for i, part in enumerate(parts) if part.startswith("decode "))
    parts.insert(at + 1, counts.text())
    return " | ".join(parts)


# --- kvlab chat ----------------------------------------------------------------------------------------------
def engine_chat(model: Any, tokenizer: Any, args: argparse.Namespace, spec: SpeculativeConfig,
                sampling: Any) -> Any:
    """A Chat whose replies run through one Engine for the whole conversation, prefix caching on: each turn
    is a request for the rendered history (earlier replies as the ids generated), and reuses its blocks."""
    from kvlab.cli.chat import Chat, stream_decoder

    class EngineChat(Chat):
        def __init__(self) -> None:
            super().__init__(model, tokenizer, args, sampling=sampling)
            context = model.config.max_position_embeddings
            self.engine = engine_for_one(model, tokenizer, spec, args.kv_dtype, context, prefix_caching=True)
            warm_up(self.engine, 0)

        def save(self, path: str) -> None:
            self.note("error: /save is not available with --speculative-config (the conversation's K/V lives "
                      "in the engine's prefix cache)")

        def load(self, path: str) -> None:
            self.note("error: /load is not available with --speculative-config")

        def reply(self) -> bool:
            ids = self._fit()
            if ids is None:
                return False
            a = self.args
            room = model.config.max_position_embeddings - len(ids)
            params = SamplingParams(**self.sampling.values, seed=None if a.seed is None else a.seed + self.replies,
                                    max_tokens=min(a.max_tokens, room), stop_token_ids=tuple(self.stop),
                                    grammar=self.grammar)
            self.replies += 1
            new: list[int] = []
            decoder = stream_decoder(self.tokenizer, ids)
            times: list[float] = []

            def on_token(token: int) -> None:
                times.append(time.perf_counter())
                new.append(token)
                self.out.write(decoder.push(token))
                self.out.flush()

            before = spec_counts(self.engine)
            start = time.perf_counter()
            reused = 0
            try:
                out = stream_request(self.engine, f"turn-{self.replies}", ids, params, on_token)
                reused = out.num_cached_tokens
            except KeyboardInterrupt:
                self.note("\n(interrupted)")
            self.out.write(decoder.flush() + "\n")
            self.out.flush()
            self.conversation.add("assistant", self.tokenizer.decode(new), new)
            prefill = (times[0] - start) if times else 0.0
            decode = times[-1] - times[0] if len(times) > 1 else 0.0
            speed = f"{(len(new) - 1) / decode:.1f} tok/s" if decode > 0 else "-"
            tokens = len(ids) + max(len(new) - 1, 0)
            pool = self.engine.block_pool
            self.note(f"[{prompt_tokens_text(len(ids), reused)} · cache {tokens} tok "
                      f"{human_bytes(tokens * pool.bytes_per_block // pool.block_size)} · prefill "
                      f"{prefill * 1e3:.1f} ms · decode {speed} · {(spec_counts(self.engine) - before).text()}]")
            return True

    return EngineChat()
