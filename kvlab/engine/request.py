"""Requests, the sequences they run as, and what the engine reports back (vLLM's names).

A Request is one prompt with its SamplingParams; it runs as `n` Sequences (samples). Sample 0 prefills
the prompt; the others are forked from it when the prompt's first token is sampled, sharing its blocks
(copy-on-write). A Sequence holds its token ids (prompt + output), how many of them have K/V in the pool
(num_computed_tokens) and its block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvlab.sampling.sampler import Sampler, SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    PENDING_FORK = "pending_fork"  # a sample i > 0 before sample 0 has finished the prompt


@dataclass
class CompletionOutput:
    """One sample's output so far."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None


@dataclass
class PromptScore:
    """What a scoring request (Engine.score) collects as its prompt runs: the logits after every prompt
    token, and how many K/V rows its queries saw (a cache policy bounds them; evicted = fed - rows)."""

    logits: list = field(default_factory=list)  # one [vocab] row per prompt token, in order
    peak_rows: int = 0  # most rows the sequence's cache held after a step
    rows: int = 0       # rows it holds now


@dataclass
class RequestOutput:
    """A request's state after a step: prompt, cache hit, and every sample's tokens so far."""

    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    outputs: list[CompletionOutput]


class Sequence:
    """One sample of a request: token ids, K/V progress and block table."""

    def __init__(self, request: "Request", index: int) -> None:
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed_tokens = 0
        # one block table per KV-cache group (kvlab/engine/kv_groups.py); block_table is group 0's
        self.block_tables: list[list[int]] = [[] for _ in range(request.num_kv_groups)]
        self.block_keys: list[bytes] = []  # prefix-cache keys of the table's leading full blocks
        self.status = Status.WAITING if index == 0 else Status.PENDING_FORK
        self.sampler = Sampler(request.params.for_sample(index))
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.admitted_at = -1  # admission counter: the newest running sequence is preempted first
        self.decoder: Any = None  # incremental detokenizer, when the engine has a tokenizer
        self.text = ""
        self.text_end: int | None = None  # where a stop string cut the text
        self.kv_view: Any = None  # a cache policy's kept rows (kvlab/engine/kv_bounds.py PolicyView)
        self.draft: list[int] = []  # this step's speculative guesses (kvlab/engine/speculative.py)
        self.num_speculative_tokens = 0  # the adaptive guess count (0: this sequence does not speculate)
        self.spec_pause = self.spec_misses = 0  # steps to sit out, and one-guess verifications that kept nothing
        self.num_drafted = self.num_accepted = 0  # guesses made and kept over its life (explorer, stats)

    @property
    def block_table(self) -> list[int]:
        """The table of KV-cache group 0 (the full-attention layers', or every layer's)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def seats(self) -> int:
        """max_num_seqs slots this sequence holds: sample 0 holds its future forks' seats too."""
        return self.request.params.n if self.index == 0 and not self.request.forked else 1

    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def completion(self) -> CompletionOutput:
        text = None
        if self.decoder is not None:
            text = self.text if self.text_end is None else self.text[:self.text_end]
        return CompletionOutput(self.index, list(self.output_token_ids), text, self.finish_reason,
                                None if self.logprobs is None else list(self.logprobs))


@dataclass
class Request:
    """A prompt and its SamplingParams, run as params.n sequences."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    root_key: bytes  # prefix-cache chain root: model fingerprint, dtypes, cache_salt
    max_tokens: int  # resolved: params.max_tokens, or what is left of the context
    stop_ids: frozenset[int] = frozenset()  # resolved: stop_token_ids, plus the EOS ids unless ignore_eos
    num_cached_tokens: int = 0  # prefix hit of the first admission
    forked: bool = False
    admitted: bool = False
    seqs: list[Sequence] = field(default_factory=list)
    num_kv_groups: int = 1  # block tables per sequence: one per KV-cache group of the engine
    score: PromptScore | None = None  # set by Engine.score: keep every prompt row's logits

    def __post_init__(self) -> None:
        self.forked = self.params.n == 1
        self.seqs = [Sequence(self, i) for i in range(self.params.n)]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def finished(self) -> bool:
        return all(s.finished() for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, list(self.prompt_token_ids), self.num_cached_tokens,
                             self.finished(), [s.completion() for s in self.seqs])
