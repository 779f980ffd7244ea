"""The decode loop: prefill, then decode one token per step, until a stop reason from one enum.

Every generating path of kvlab runs this loop or its stop rule: `generate`/`stream_generate` (a batch over a
KVCache), `Session.stream` (tokens fed back as they are chosen), the prompt cache, and the engine's
per-sequence stop checks (`stop_reason`). Why one: the rules (a stop token ends a row and is kept; the token
limit counts new tokens; the end of the context is its own reason) were written four times and drifted; now
a fix lands everywhere.
"""

from __future__ import annotations

from collections.abc import Generator
from enum import Enum
from typing import Any, Callable, Container, Iterable, Iterator

import numpy as np


class StopReason(Enum):
    """Why generation ended. `value` is the CLI's wording; `finish_reason` the OpenAI/vLLM one."""

    EOS = "eos"                    # a stop token id (end-of-sequence or stop_token_ids)
    STOP_STRING = "stop string"    # a stop string appeared in the text
    MAX_TOKENS = "max tokens"      # the caller's limit of new tokens
    CONTEXT_FULL = "context full"  # no position left in the context
    ABORT = "abort"                # the caller stopped it
    INTERRUPTED = "interrupted"    # Ctrl-C

    @property
    def finish_reason(self) -> str:
        """"stop", "length" or "abort", as the OpenAI API and vLLM's RequestOutput report it."""
        if self in (StopReason.EOS, StopReason.STOP_STRING):
            return "stop"
        if self in (StopReason.MAX_TOKENS, StopReason.CONTEXT_FULL):
            return "length"
        return "abort"


def stop_reason(token: int, num_new: int, stop_ids: Container[int], max_tokens: int,
                room: int | None = None) -> StopReason | None:
    """Whether generation ends after `token`, the `num_new`-th new token: a stop id first (it is kept),
    then the context (`room`: new tokens the context holds), then the limit; None to go on."""
    if token in stop_ids:
        return StopReason.EOS
    if room is not None and num_new >= room:
        return StopReason.CONTEXT_FULL
    if num_new >= max_tokens:
        return StopReason.MAX_TOKENS
    return None


class DecodeLoop(Generator):
    """A generator of each step's tokens; `reason` says why it ended once it has.

    `step(None)` runs the prefill (or returns logits already known) and `step(tokens [B, 1])` one decode
    step; both return the last position's logits [B, vocab]. `sample` maps logits to ids [B]. A row that
    emits a stop id is finished: later steps give it `pad`; the loop ends when every row is finished or
    `max_new_tokens` were chosen. With `feed_back=False` the last token chosen is not fed back (nothing
    needs its K/V); with `feed_back=True` every token is fed back before it is yielded, so the caller's
    cache always holds everything yielded (a Session). `room`: new tokens the context holds (ending there
    reads CONTEXT_FULL). `single=True` yields plain ints (batch 1) instead of [B] arrays. Nothing runs
    before the first `next()`.
    """

    def __init__(self, step: Callable[[np.ndarray | None], np.ndarray],
                 sample: Callable[[np.ndarray], np.ndarray], max_new_tokens: int, stop_ids: Iterable[int],
                 *, pad: int = 0, room: int | None = None, feed_back: bool = False, single: bool = False) -> None:
        self.step = step
        self.sample = sample
        self.max_new_tokens = max_new_tokens
        self.stop = np.array(sorted(set(int(t) for t in stop_ids)), dtype=np.int64)
        self.pad = pad
        self.room = room
        self.feed_back = feed_back
        self.single = single
        self.num_new = 0
        self.reason: StopReason | None = None
        self._steps = self._run()

    def send(self, value: Any) -> Any:
        return self._steps.send(value)

    def throw(self, *args: Any) -> Any:
        return self._steps.throw(*args)

    def close(self) -> None:
        self._steps.close()

    def _run(self) -> Iterator[Any]:
        if self.max_new_tokens == 0:
            self.reason = stop_reason(-1, 0, (), 0, self.room)
            return
        logits = self.step(None)
        finished: np.ndarray | None = None
        while True:
            tokens = np.asarray(self.sample(logits))
            finished = np.zeros(tokens.shape[0], dtype=bool) if finished is None else finished
            tokens = np.where(finished, self.pad, tokens)
            finished = finished | np.isin(tokens, self.stop)
            self.num_new += 1
            # the batch ends when every row met a stop id, else by the one rule for the context and the limit
            self.reason = StopReason.EOS if finished.all() else \
                stop_reason(-1, self.num_new, (), self.max_new_tokens, self.room)
            if self.feed_back:
                logits = self.step(tokens[:, None])
            yield int(tokens[0]) if self.single else tokens
            if self.reason is not None:
                return
            if not self.feed_back:
                logits = self.step(tokens[:, None])
