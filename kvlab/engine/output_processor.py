"""The output stage: what happens to a step's logits after the forward (vLLM's OutputProcessor, split from its
scheduler).

Each sequence whose last scheduled token ended its known tokens gets its next token, all of them drawn in one
`sample_rows` call; sample 0 of an n > 1 request forks its siblings at that first token (the scheduler shares
the blocks, copy-on-write: `Scheduler.fork`), and they draw from its row. Each token is appended with its
logprobs, detokenized incrementally, and the decode loop's stop rule (kvlab/generation/loop.py) plus stop
strings and a failed grammar decide whether the sequence ends. Ending is decided here; `Scheduler.finish`
gives its blocks back.
"""

from __future__ import annotations

import numpy as np

from kvlab.engine.counters import StepCounters
from kvlab.engine.request import Sequence
from kvlab.engine.scheduler import Scheduler
from kvlab.generation.loop import StopReason, stop_reason
from kvlab.sampling.sampler import sample_rows, top_logprobs


class OutputProcessor:
    """Sampling, forks, detokenization and stop rules after each forward; the scheduler keeps the blocks."""

    def __init__(self, scheduler: Scheduler, counters: StepCounters | None = None) -> None:
        self.scheduler = scheduler
        self.counters = counters if counters is not None else StepCounters()

    def process(self, sampled: list[Sequence], logits: np.ndarray) -> None:
        """Sample every sequence's next token from its logits row in one call (forking siblings at the
        first one: they share sample 0's row), then detokenize and apply the stop rule."""
        targets, rows = [], []
        for row, seq in enumerate(sampled):
            targets.append(seq)
            rows.append(row)
            request = seq.request
            if not request.forked:  # sample 0 has just finished the prompt: the other samples start here
                for child in request.seqs[1:]:
                    self.scheduler.fork(seq, child)
                    targets.append(child)
                    rows.append(row)
                request.forked = True
        if len(targets) == 1:  # batch 1 (the CLI's every step): its sampler on its row, no copy of the logits
            tokens = targets[0].sampler(logits[rows[0]:rows[0] + 1])  # sample_rows' draw for one row
        else:
            tokens = sample_rows([target.sampler for target in targets], logits[rows])
        for target, row, token in zip(targets, rows, tokens.tolist()):
            reason = self.emit(target, token, logits[row])
            if reason is not None:
                self.finish(target, reason.finish_reason)

    def emit(self, seq: Sequence, token: int, row: np.ndarray) -> StopReason | None:
        """Append one sampled token (its logprobs from its logits `row`), detokenize it and say whether it
        ends the sequence; the caller finishes it (speculation commits the accepted rows first)."""
        seq.token_ids.append(token)
        self.counters.num_generation_tokens += 1
        if seq.logprobs is not None:
            seq.logprobs.append(top_logprobs(row, token, seq.request.params.logprobs))
        return self._stop_reason(seq, token)

    def _stop_reason(self, seq: Sequence, token: int) -> StopReason | None:
        params = seq.request.params
        num_new = len(seq.token_ids) - seq.request.num_prompt_tokens
        reason = stop_reason(token, num_new, seq.request.stop_ids, seq.request.max_tokens)
        if seq.sampler.failure is not None:  # its grammar failed: what it has is no finished answer
            reason = StopReason.ABORT
        if seq.decoder is not None and reason is not StopReason.EOS:  # a stop token is kept in ids, not text
            before = len(seq.text)
            seq.text += seq.decoder.push(token)
            if params.stop:
                longest = max(len(s) for s in params.stop)
                window = max(0, before - longest + 1)
                found = [i for i in (seq.text.find(s, window) for s in params.stop) if i >= 0]
                if found:
                    seq.text_end = min(found)
                    reason = StopReason.STOP_STRING
        return reason

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` with finish reason "stop", "length" or "abort": the scheduler gives its blocks back, its
        held-back text is flushed, and an unforked sample 0 takes the samples that were to fork from it along."""
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        if seq.decoder is not None and seq.text_end is None:
            seq.text += seq.decoder.flush()
        if seq.index == 0 and not seq.request.forked:  # the samples that were to fork from it end too
            for sibling in seq.request.seqs[1:]:
                if not sibling.finished():
                    self.finish(sibling, reason)
