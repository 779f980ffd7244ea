"""A cache policy by hand on the contiguous reference cache: what the engine's policies
(kvlab/engine/kv_bounds.py) must compute, written plainly and in the other position convention, so that
`kvlab verify`'s "policy" schedule (and the engine's policy tests) check the engine against it.

Before a chunk of n tokens, the policy keeps `keep(L, n)` of the L cached rows and they move to positions
0..k-1 (StreamingLLM's positions within the cache; llama.cpp's context shift): each kept key, cached after
RoPE, turns by its new position's angles minus its old (`RopeTables.angles`, in float64; NoPE layers not at
all), and the chunk runs on a KVCache built from the kept rows (`KVCache.from_arrays`), its new rows at
k, k+1, ... The engine instead keeps the tail at its text positions and re-rotates only the prefix rows;
RoPE scores depend only on query-key distances, so both give the same logits up to rounding.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvlab.cache.kv_cache import KVCache
from kvlab.model.llama import LlamaModel
from kvlab.policies.base import Policy
from kvlab.policies.shift import rotate_keys


class PolicyCache:
    """One sequence's cache under `policy`; `feed(ids)` runs a chunk and returns its logits [n, vocab]."""

    def __init__(self, model: LlamaModel, policy: Policy) -> None:
        self.model, self.policy = model, policy
        self.keys: list[np.ndarray] | None = None  # per layer [1, H_kv, L, d], keys at positions 0..L-1
        self.values: list[np.ndarray] | None = None
        self.evicted = 0  # rows the last feed dropped

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def make_room(self, num_new: int) -> int:
        """Drop rows as the policy says so that `num_new` more fit its budget; how many were dropped."""
        if not 1 <= num_new <= self.policy.max_chunk:
            raise ValueError(f"{self.policy} takes 1..{self.policy.max_chunk} new tokens a chunk, got {num_new}")
        length = self.length
        if length + num_new <= self.policy.budget:
            return 0
        rows = np.asarray(self.policy.keep(length, num_new), dtype=np.int64)
        if np.any(np.diff(rows) <= 0) or rows.size + num_new > self.policy.budget:
            raise ValueError(f"{self.policy} kept rows {rows.tolist()} of {length}: not ascending within its budget")
        tables = self.model.rope_tables  # each kept key turns by its new position's angles minus its old
        angles = tables.angles(np.arange(rows.size)) - tables.angles(rows)
        self.keys = [rotate_keys(k[:, :, rows], angles) if rows.size and rope != "none"
                     else k[:, :, rows] for rope, k in zip(self.model.layer_rope, self.keys)]  # NoPE: none
        self.values = [v[:, :, rows] for v in self.values]
        return length - int(rows.size)

    def feed(self, ids: Sequence[int], chunk: int | None = None, logits_to_keep: int = 0) -> np.ndarray:
        """Run `ids` in chunks of `chunk` tokens (default and at most the policy's max_chunk), each after
        make_room; their logits [len(ids), vocab] (`logits_to_keep` k: each chunk's last k rows only)."""
        size = min(chunk or self.policy.max_chunk, self.policy.max_chunk)
        ids, out, self.evicted = [int(t) for t in ids], [], 0
        for start in range(0, len(ids), size):
            part = ids[start:start + size]
            self.evicted += self.make_room(len(part))
            cache = self.model.new_cache(1) if not self.length else KVCache.from_arrays(
                self.model.cache_spec, self.keys, self.values, np.arange(self.length))
            out.append(self.model.forward(np.asarray([part]), cache=cache, logits_to_keep=logits_to_keep).logits[0])
            self.keys = [k.copy() for k, _ in cache]
            self.values = [v.copy() for _, v in cache]
        return np.concatenate(out)


def greedy_tokens(model: LlamaModel, policy: Policy, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens under `policy`, the prompt in chunks of max_chunk then one token a step."""
    cache = PolicyCache(model, policy)
    logits, tokens = cache.feed(prompt)[-1], []
    for step in range(max_new_tokens):
        tokens.append(int(np.argmax(logits)))
        if step + 1 < max_new_tokens:  # the last token is never fed back, as in the engine
            logits = cache.feed([tokens[-1]])[-1]
    return tokens
