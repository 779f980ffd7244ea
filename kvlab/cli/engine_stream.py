"""`kvlab generate` and `kvlab chat` on the Engine: the one runtime the CLI and the server share.

The CLI builds an Engine for one sequence at a time (a pool sized for the run, prefix caching on), adds one
request per completion or chat turn and prints the text of each RequestOutput as it arrives. So the commands
get what the engine has, written once: prefix caching across chat turns, `--kv-tier` (a second process reuses
what a first wrote to a disk or Valkey tier), the engine's cache policies (window, sinks, context shift),
speculative decoding (`--speculative-config`, same text as without: kvlab/engine/speculative.py), grammars,
and `--prompt-cache FILE` (a session file read into the prefix cache and written back from it:
kvlab/sessions/session_io.py). Bad flags exit 2 naming the field before any model is loaded.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvlab.cli.checks import drawn_seed_note
from kvlab.engine.engine import Engine
from kvlab.engine.request import RequestOutput
from kvlab.engine.speculative import SpeculativeConfig
from kvlab.errors import ConfigError
from kvlab.progress import KernelCompiles, compiling_kernels
from kvlab.sampling.sampler import SamplingParams

FLAG_HELP = ("speculative decoding as vLLM spells it, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}' "
             "(prompt lookup; also prompt_lookup_max/prompt_lookup_min) or '{\"method\": \"draft_model\", "
             "\"model\": PATH, \"num_speculative_tokens\": 3}'; same text as without")
KV_TIER_HELP = ("a K/V tier behind the prefix cache, repeatable, tried in order: file:///DIR (survives the "
                "process: a second run reuses the prompt's blocks), redis://HOST:PORT/DB or valkey://...")


def add_speculative_flag(parser: argparse.ArgumentParser) -> None:
    """--speculative-config JSON (--speculative_config too: the CLI accepts either spelling of any flag)."""
    parser.add_argument("--speculative-config", dest="speculative_config", metavar="JSON", default=None,
                        help=FLAG_HELP)


def add_kv_tier_flag(parser: Any) -> None:
    """--kv-tier URL, repeatable (the server's flag)."""
    parser.add_argument("--kv-tier", action="append", default=None, metavar="URL", help=KV_TIER_HELP)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The parsed flag, or None; ConfigError (exit 2) naming the field, before anything is loaded."""
    spec = getattr(args, "speculative_config", None)
    if spec is None:
        return None
    try:
        return SpeculativeConfig.parse(spec)
    except ConfigError as exc:
        raise ConfigError(f"--speculative-config: {exc}") from None


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
    """Compile (first run) or load the paged and verification kernels with throwaway repeating requests, so
    the timed prefill and decode are their own; seconds spent if numba compiled anything, else 0. The K/V tier
    and events do not hear of them (their blocks are neither stored nor announced) and the prefix cache
    forgets them."""
    listeners = engine.prefix_cache.listeners
    detached, listeners[:] = listeners[:], []
    try:
        with compiling_kernels() as compiled:  # twice: the second run starts from a prefix-cache hit
            for _ in range(2):
                engine.generate([[first_token] * 20], SamplingParams(max_tokens=4, ignore_eos=True))
        for group in engine.kv_groups:  # not reset_prefix_cache: that would announce AllBlocksCleared
            group.prefix_cache.evict_all()
    finally:
        listeners[:] = detached
    return compiled.seconds


def engine_for_one(model: Any, tokenizer: Any, spec: SpeculativeConfig | None, kv_dtype: Any, tokens: int,
                   eos_token_ids: Sequence[int], policy: Any = None,
                   kv_tiers: Sequence[str] | None = None) -> Engine:
    """An engine for one sequence at a time, prefix caching on: a pool for `tokens` plus the guesses' rows
    (a cache policy sizes its own). The engine detokenizes nothing (the CLI's stream does); it is given the
    tokenizer only to check a draft model's. `eos_token_ids`: what ends a reply (the config's and the
    tokenizer's, as the grammar allows them), unless a request says ignore_eos."""
    guesses = spec.num_speculative_tokens if spec is not None else 0
    tokens = max(tokens, 24)  # and the warm-up's
    blocks = None if policy is not None else -(-(tokens + guesses + 1) // 16) + 1
    engine = Engine(model, tokenizer if spec is not None and spec.method == "draft_model" else None,
                    speculative_config=spec, max_num_seqs=1, kv_cache_dtype=kv_dtype, num_blocks=blocks,
                    block_size=16, kv_policy=policy, enable_prefix_caching=True, kv_tiers=kv_tiers)
    engine.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
    return engine


def row_bytes(engine: Engine, rows: int) -> int:
    """K/V bytes of `rows` cached rows in the engine's pool (the stats lines' and /save's figure)."""
    return rows * engine.block_pool.bytes_per_block // engine.block_pool.block_size


def stop_words(finish_reason: str | None, num_new: int, wanted: int | None) -> str:
    """The engine's finish reason in the stats line's words (StopReason values); `wanted`: -n (None: -1)."""
    if finish_reason == "stop":
        return "eos"
    if finish_reason == "length":
        return "max tokens" if wanted is not None and num_new >= wanted else "context full"
    return finish_reason or "abort"


# --- kvlab generate ------------------------------------------------------------------------------------------
def generate_with_engine(args: argparse.Namespace, model: Any, tokenizer: Any, text: str, prompt: list[int],
                         spec: SpeculativeConfig | None, resolved: Any, seed_drawn: bool, policy: Any) -> int:
    """`kvlab generate` through the Engine: echo the prompt, stream the completion, one stats line. With
    --prompt-cache FILE the file's blocks seed the prefix cache first and the run's are written back after."""
    from kvlab.cli.generate import check_prompt, open_stream, stop_token_ids
    from kvlab.cli.sampling_flags import compiled_grammar
    from kvlab.sessions.session_io import load_session, save_session
    from kvlab.errors import ContextLengthError

    context = model.config.max_position_embeddings
    check_prompt(prompt, context, policy)
    stop = stop_token_ids(model, tokenizer)
    room = context - len(prompt)
    if policy is None and room < 1:
        raise ContextLengthError(f"the prompt is {len(prompt)} tokens: no room left in the model's context of "
                                 f"{context} tokens")
    wanted = None if args.max_tokens == -1 else args.max_tokens
    max_tokens = (wanted if wanted is not None else 1 << 30) if policy is not None else \
        min(wanted if wanted is not None else room, room)
    engine = engine_for_one(model, tokenizer, spec, args.kv_dtype, len(prompt) + max_tokens
                            if policy is None else 0, stop, policy, getattr(args, "kv_tier", None))
    try:
        compile_seconds = warm_up(engine, prompt[0])
        if args.prompt_cache and (Path(args.prompt_cache).exists() or Path(args.prompt_cache).is_symlink()):
            load_session(engine, args.prompt_cache)  # refused (exit 2) if damaged or from another model
        params = SamplingParams(**resolved.values, seed=args.seed, max_tokens=max_tokens,
                                ignore_eos=args.ignore_eos,  # the engine's eos_token_ids end it otherwise
                                grammar=compiled_grammar(args, tokenizer, model.config.vocab_size, stop))
        stream = open_stream(args, tokenizer, text, prompt, [] if args.ignore_eos else stop, resolved,
                             seed_drawn)
        before = spec_counts(engine)
        stream.start()
        compiles = KernelCompiles().start()  # a compile the warm-up did not cover: kept out of the figures
        try:
            out = stream_request(engine, "generate", prompt, params, stream.on_token)
            reason = stop_words(out.outputs[0].finish_reason, len(stream.tokens), wanted)
            computed = len(prompt) - out.num_cached_tokens
        except KeyboardInterrupt:
            computed, reason = len(prompt), "interrupted"
        finally:
            compiles.stop()
        stream.finish()
        if args.prompt_cache and reason != "interrupted":  # prompt + new tokens, those with K/V
            save_session(engine, args.prompt_cache, (prompt + stream.tokens)[:len(prompt) + len(stream.tokens) - 1],
                         {})
        line = engine_stats_line(stream, engine, len(prompt), computed, reason,
                                 spec_counts(engine) - before if spec is not None else None, compiles,
                                 compile_seconds)
    finally:
        engine.close()
    print(line + f" | sampling: {resolved.summary()}"
          + (f" | {drawn_seed_note(args.seed)}" if seed_drawn else ""), file=sys.stderr, flush=True)
    return 130 if reason == "interrupted" else 0


def engine_stats_line(stream: Any, engine: Engine, prompt_tokens: int, computed: int, reason: str,
                      counts: SpecCounts | None, compiles: KernelCompiles, warm_up_seconds: float) -> str:
    """generate's stats line, the cache being the engine's rows for this sequence; with speculation,
    `drafted D, accepted A (R %)` after the decode figures."""
    tokens = prompt_tokens + max(len(stream.tokens) - 1, 0)  # the last token's K/V is never computed
    stats = stream.stats(prompt_tokens, computed, tokens, row_bytes(engine, tokens),
                         str(getattr(engine.kv_cache_dtype, "name", engine.kv_cache_dtype)), reason, compiles)
    stats.compile_seconds += warm_up_seconds
    if counts is None:
        return stats.line()
    parts = stats.line().split(" | ")
    at = next(i for i, part in enumerate(parts) if part.startswith("decode "))
    parts.insert(at + 1, counts.text())
    return " | ".join(parts)
