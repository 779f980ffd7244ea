"""StepCounters: the tokens an engine has computed, in a file of their own so the parts that add to them (the
model runner, the output stage, speculation) import them without importing introspection.py, which reads the
engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepCounters:
    """Tokens the engine has computed, for `Engine.stats` (Prometheus counters in the server)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_computed_tokens: int = 0
    num_prefill_tokens: int = 0
    num_steps: int = 0
    # speculative decoding (vLLM's spec_decode_* counters): verifications, guesses, guesses kept, and kept
    # guesses by position (index i: how often the i+1-th guess survived)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
