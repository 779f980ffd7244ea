"""Speculative decoding: guess a few tokens, verify them all in one forward, keep what the model agrees with.

A decode step reads every weight to compute one row, so a step that computes k + 1 rows costs little more
than one. A proposer guesses the next k tokens; the engine schedules the sequence's last token plus the k
guesses as one chunk; the target model's logits at row i say what plain decoding would have emitted after
the first i guesses. The output stage (`accept`) walks the rows in order: row i's token is drawn exactly as
plain decoding draws it (the argmax, or the sequence's sampler taking its next draw, one draw per emitted
token), and guess i + 1 survives iff it equals that token. The first disagreement's token is emitted in the
guess's place (the "bonus"), and nothing after it. So the emitted text is plain decoding's, token for token,
for greedy and for seeded sampling alike: the draws are consumed in the same order, one per emitted token,
whether or not a guess was there. (vLLM's rejection sampler keeps the distribution; this keeps the text.)

Rows of rejected guesses never become visible: the runner commits only the accepted rows
(`num_computed_tokens`), so only blocks made of accepted rows enter the prefix cache, a tier or a KV event,
and the table's blocks past the kept tokens go back to the pool. A rejected row's K/V sits at a position the
next step writes again before any query can read it.

Proposers (vLLM's `speculative_config` spelling):
  * "ngram": prompt lookup (Saxena's prompt-lookup decoding, vLLM's ngram, transformers'
    prompt_lookup_num_tokens): the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are
    searched for in the sequence's earlier tokens, most recent match first; the tokens that followed it
    are the guesses. Free when nothing matches (no guesses, no extra rows).
  * "draft_model": a smaller model with the same tokenizer runs greedily ahead of the target on its own
    contiguous cache (kvlab/engine/draft.py).
Adaptive: no guesses at all while `disable_by_batch_size` or more sequences run; each sequence's guess count
halves after a verification that kept nothing and grows back by one after one that kept everything; and once
a single guess is rejected too, the sequence sits out 1, then 2, 4 .. MAX_PAUSE steps while its one-guess
verifications keep failing (any kept guess ends the pause's doubling). Free text, where the lookup matches
but the model goes its own way, then pays for a verification row now and then rather than every step: on an
AVX2 CPU without VNNI two rows cost a step 1.3-1.4x one row (Zen 3, `python bench/bench_ab_decode.py --old .
--new . --configs numba-q4_1+q8-1:256 numba-q4_1+q8-2:256`), more than a guess kept 17 % of the time buys
back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab.errors import ConfigError

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields that kvlab reads (others are refused, naming them)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None  # at this many running sequences or more: no guesses that step

    @classmethod
    def parse(cls, spec: Any) -> "SpeculativeConfig | None":
        """A config from a JSON string, a dict or a SpeculativeConfig; None stays None. ConfigError names
        the field that is wrong; nothing is loaded here (a draft model's path is only checked to exist)."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc.msg} at character {exc.pos}") \
                    from None
        if not isinstance(spec, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {spec!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                 "disable_by_batch_size"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown field {unknown[0]!r} (kvlab reads "
                              f"{', '.join(sorted(known))})")
        method = spec.get("method")
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        k = _int_field(spec, "num_speculative_tokens", None, low=1)
        high = _int_field(spec, "prompt_lookup_max", 4, low=1)
        low = _int_field(spec, "prompt_lookup_min", min(2, high), low=1)
        if low > high:
            raise ConfigError(f"speculative_config.prompt_lookup_min {low} exceeds prompt_lookup_max {high}")
        off = None if spec.get("disable_by_batch_size") is None else _int_field(spec, "disable_by_batch_size", None,
                                                                                 low=1)
        model = spec.get("model")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ConfigError("speculative_config.model: the draft_model method needs the path of a model "
                                  "(an HF folder or a GGUF file)")
            from pathlib import Path
            if not Path(model).exists():
                raise ConfigError(f"speculative_config.model: {model} does not exist")
        elif model is not None:
            raise ConfigError("speculative_config.model is only read by the draft_model method")
        return cls(method, k, high, low, model, off)


def _int_field(spec: dict, name: str, default: int | None, low: int) -> int:
    value = spec.get(name, default)
    if value is None:
        raise ConfigError(f"speculative_config.{name} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"speculative_config.{name} must be an integer >= {low}, got {value!r}")
    return value


def ngram_lookup(token_ids: list[int], max_tokens: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to `max_tokens` guesses: what followed the most recent earlier occurrence of the sequence's last n
    tokens, trying the longest n first. [] when nothing matches."""
    length = len(token_ids)
    if max_tokens < 1 or length < lookup_min + 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        # windows starting at 0..length-1-n: each has at least one token after it, and none is the suffix
        windows = np.lib.stride_tricks.sliding_window_view(ids[:length - 1], n)
        hits = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + max_tokens].tolist()
    return []


@dataclass
class Acceptance:
    """What verification kept: the tokens to emit (accepted guesses, then the bonus token) and how many of
    the guesses survived."""

    tokens: list[int]
    num_accepted: int


def accept(draft: list[int], rows: np.ndarray, draw: Any) -> Acceptance:
    """Walk rows [len(draft) + 1, vocab] in order: `draw(row)` is plain decoding's token after the tokens
    so far; guess i survives iff it equals row i's token. Stops at the first disagreement (its token is the
    bonus), so `draw` is called once per emitted token, as plain decoding calls it."""
    tokens = []
    for i in range(len(draft) + 1):
        token = int(draw(rows[i:i + 1]))
        tokens.append(token)
        if i == len(draft) or token != draft[i]:
            return Acceptance(tokens, i)
    raise AssertionError("unreachable")


MAX_PAUSE = 16  # the most steps a sequence sits out after its one-guess verifications kept nothing


def adapt(k: int, k_max: int, num_drafted: int, num_accepted: int, misses: int = 0) -> tuple[int, int, int]:
    """(the next guess count, steps to sit out, one-guess misses in a row) after a verification: the count
    halved after keeping none, one more after keeping all (at most k_max); a single guess rejected sits out
    2 ** misses steps (at most MAX_PAUSE), misses counting up until a guess is kept."""
    if not num_drafted:
        return k, 0, misses
    if num_accepted == 0:
        if k == 1:
            return 1, min(MAX_PAUSE, 2 ** misses), misses + 1
        return max(1, k // 2), 0, misses
    if num_accepted == num_drafted:
        return min(k_max, k + 1), 0, 0
    return k, 0, 0


class Speculator:
    """The engine's speculation: guesses before the schedule, verification after the forward."""

    def __init__(self, config: SpeculativeConfig, bounds: Any, max_model_len: int,
                 draft: Any = None) -> None:
        self.config, self.bounds, self.max_model_len = config, bounds, max_model_len
        self.draft = draft  # a DraftProposer for method "draft_model"

    def propose_all(self, running: list[Any]) -> None:
        """This step's guesses for every running sequence, or none at all when `disable_by_batch_size`
        sequences or more are running (vLLM's rule): a step shared by many sequences is bound by compute,
        not by reading the weights, so each verified row costs about what a decoded row costs and every
        rejected guess is a loss (bench/bench_speculative.py, batch 8). A sequence that skips a step loses
        nothing: its adaptive count is kept, and a draft model catches up on the tokens it missed."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            for seq in running:
                seq.draft = []
            return
        for seq in running:
            self.propose(seq)

    def propose(self, seq: Any) -> None:
        """Set `seq.draft` for this step: [] unless it is decoding and a guess fits (its token limit, the
        context, a cache policy's budget without eviction, the whole pool). A grammar needs nothing here: each
        kept token is drawn through the sequence's sampler, which masks the row with the matcher's state after
        the tokens before it (the accepted guesses) and advances it, so a rejected guess never reaches the
        matcher."""
        seq.draft = []
        if seq.num_tokens - seq.num_computed_tokens != 1:
            return
        if not seq.request.forked:  # the prompt's first token forks the other samples (OutputProcessor.process)
            return
        if seq.num_speculative_tokens == 0:
            seq.num_speculative_tokens = self.config.num_speculative_tokens
        if seq.spec_pause > 0:  # its last single guess was rejected: this step decodes one token (`adapt`)
            seq.spec_pause -= 1
            return
        left = seq.request.max_tokens - (seq.num_tokens - seq.request.num_prompt_tokens)
        room = min(seq.num_speculative_tokens, left - 1, self.max_model_len - seq.num_tokens)
        rows = self.bounds.rows_before_eviction(seq)
        if rows is not None:  # guesses must not make a policy evict what plain decoding would keep
            room = min(room, rows - 1)
        while room > 0 and self.bounds.max_blocks(seq.num_tokens + room) > self.bounds.pool.num_blocks:
            room -= 1  # nor outgrow the whole pool, which plain decoding ends ("length") without a liveness error
        if room < 1:
            return
        if self.draft is not None:
            seq.draft = self.draft.propose(seq, room)
        else:
            seq.draft = ngram_lookup(seq.token_ids, room, self.config.prompt_lookup_max,
                                     self.config.prompt_lookup_min)

    def verify(self, seq: Any, rows: np.ndarray, output: Any, runner: Any, counters: Any) -> None:
        """Accept guesses against the target's rows, emit the kept tokens through the output stage
        (kvlab/engine/output_processor.py), commit their rows, stop if a token ends the sequence."""
        draft = list(seq.draft)
        result = accept(draft, rows, lambda row: seq.sampler(row)[0])
        reason, emitted = None, 0
        for i, token in enumerate(result.tokens):
            emitted += 1
            reason = output.emit(seq, token, rows[i])
            if reason is not None:
                break
        runner.commit_accepted(seq, 1 + min(result.num_accepted, emitted))
        counters.spec_decode_num_drafts += 1
        counters.spec_decode_num_draft_tokens += len(draft)
        counters.spec_decode_num_accepted_tokens += result.num_accepted
        per_pos = counters.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(draft) - len(per_pos)))
        for i in range(result.num_accepted):
            per_pos[i] += 1
        seq.num_drafted += len(draft)
        seq.num_accepted += result.num_accepted
        seq.num_speculative_tokens, seq.spec_pause, seq.spec_misses = adapt(
            seq.num_speculative_tokens, self.config.num_speculative_tokens, len(draft), result.num_accepted,
            seq.spec_misses)
        if self.draft is not None:
            self.draft.rollback(seq)
        if reason is not None:
            output.finish(seq, reason.finish_reason)


def make_draft(config: SpeculativeConfig, model: Any, tokenizer: Any) -> Any:
    """The draft model's proposer for method "draft_model" (loaded and checked against the target)."""
    from kvlab.engine.draft import load_draft
    return load_draft(config.model, model, tokenizer)
