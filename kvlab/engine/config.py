"""EngineConfig: the engine's constructor arguments, checked and resolved once, before anything is allocated.

vLLM's names (block_size, num_blocks, kv_cache_memory, max_num_seqs, max_num_batched_tokens,
enable_prefix_caching, kv_cache_dtype, max_model_len) and kvlab's `kv_policy` (a cache policy run inside the
engine: kvlab/engine/kv_bounds.py). The pool's size comes from kvlab/cache/memory.py,
which also sizes `kvlab memory`, so the bytes a budget buys are the bytes the pool allocates (int8/int4
scales included), as a whole number of blocks.

A hybrid model (layers of different windows: Gemma 2/3) has one pool per KV-cache group
(kvlab/engine/kv_groups.py). A sliding group never holds more than `window_max_blocks` blocks a sequence, so
its pool is sized for that many per sequence that can run at once (max_num_seqs, or fewer when group 0 has
fewer blocks than that: every running sequence holds one of them); group 0 (the full-attention layers) gets
`num_blocks`, or the rest of the byte budget. So on a hybrid model a block count means blocks of the
full-attention layers only (block_size tokens of each of them), not of every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab import validate
from kvlab.cache.dtypes import resolve_kv_dtype
from kvlab.cache.memory import kv_bytes_per_block
from kvlab.cache.quant import QuantFormat
from kvlab.engine.kv_bounds import window_max_blocks
from kvlab.engine.kv_groups import group_window, layer_groups
from kvlab.errors import ConfigError, InputError
from kvlab.model.llama import LlamaModel
from kvlab.policies.base import Policy
from kvlab.policies.parse import parse_policy
from kvlab.policies.shift import ContextShift
from kvlab.policies.sinks import AttentionSinks
from kvlab.policies.window import SlidingWindow

ENGINE_POLICIES = (SlidingWindow, AttentionSinks, ContextShift)  # a kept prefix plus a tail (kv_bounds.py)

DEFAULT_MAX_KV_BYTES = 1 << 30  # the default pool (max_num_seqs full-context sequences) is capped at 1 GiB


@dataclass(frozen=True)
class GroupLayout:
    """One KV-cache group's pool: its layers' window (None: full attention), the layers, blocks and bytes a
    block (block_size tokens of each of its layers)."""

    window: int | None
    layers: tuple[int, ...]
    num_blocks: int
    bytes_per_block: int


@dataclass(frozen=True)
class EngineConfig:
    """Resolved engine settings: every field a plain value, every check already passed."""

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    kv_cache_dtype: np.dtype | QuantFormat
    bytes_per_block: int
    kv_policy: Policy | None = None  # window / sinks / shift; stateless, so shared by every sequence
    groups: tuple[GroupLayout, ...] = ()  # every KV-cache group's pool; groups[0] is num_blocks x bytes_per_block

    @property
    def hybrid(self) -> bool:
        """Whether the layers form more than one KV-cache group (a pool each)."""
        return len(self.groups) > 1

    @classmethod
    def create(cls, model: Any, *, block_size: int = 16, num_blocks: int | None = None,
               kv_cache_memory: int | str | None = None, max_num_seqs: int = 64,
               max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
               kv_cache_dtype: object = None, max_model_len: int | None = None,
               kv_policy: str | Policy | None = None) -> "EngineConfig":
        """Check every argument against `model` (ConfigError naming the first bad one) and size the pool:
        `num_blocks`, or as many blocks as `kv_cache_memory` holds, or enough for max_num_seqs full-context
        sequences capped at DEFAULT_MAX_KV_BYTES."""
        if not isinstance(model, LlamaModel):
            raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
        config = model.config
        block_size = validate.positive_int(block_size, "block_size", ConfigError)
        max_num_seqs = validate.positive_int(max_num_seqs, "max_num_seqs", ConfigError)
        max_num_batched_tokens = validate.positive_int(max_num_batched_tokens, "max_num_batched_tokens",
                                                       ConfigError)
        if max_model_len is None:
            max_model_len = config.max_position_embeddings
        max_model_len = validate.positive_int(max_model_len, "max_model_len", ConfigError)
        if max_model_len > config.max_position_embeddings:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's context of "
                              f"{config.max_position_embeddings} tokens (max_position_embeddings)")
        if not isinstance(enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        try:
            kv_dtype = resolve_kv_dtype(kv_cache_dtype, model.dtype)
        except InputError as exc:
            raise ConfigError(str(exc)) from None
        groups = layer_groups(config)
        sizes = [int(len(g.layers) * g.spec.bytes_per_token(kv_dtype) * block_size) for g in groups]
        bytes_per_block = sizes[0] if len(groups) > 1 else kv_bytes_per_block(config, block_size, kv_dtype)
        # a sliding group's blocks per sequence at most, and their bytes (per seat: a sequence running)
        per_seq = [window_max_blocks(max_model_len, block_size, group_window(g), max_num_batched_tokens)
                   for g in groups[1:]]
        seat_bytes = sum(n * size for n, size in zip(per_seq, sizes[1:]))
        if num_blocks is not None and kv_cache_memory is not None:
            raise ConfigError("give num_blocks or kv_cache_memory, not both")
        budget = None
        if num_blocks is not None:
            num_blocks = validate.positive_int(num_blocks, "num_blocks", ConfigError)
        elif kv_cache_memory is not None:
            try:
                budget = validate.parse_size(kv_cache_memory, "kv_cache_memory") \
                    if isinstance(kv_cache_memory, str) else validate.positive_int(kv_cache_memory,
                                                                                   "kv_cache_memory")
            except InputError as exc:
                raise ConfigError(f"kv_cache_memory: {exc}") from None
        else:  # every seat a whole context, and at least what a cache policy holds at once
            policy_need = _policy_blocks(_engine_policy(kv_policy, config, max_model_len), block_size)
            num_blocks = max(1, max_num_seqs * math.ceil(max_model_len / block_size), policy_need)
            if num_blocks * bytes_per_block + max_num_seqs * seat_bytes > DEFAULT_MAX_KV_BYTES:
                num_blocks, budget = None, DEFAULT_MAX_KV_BYTES
        if budget is not None:  # the sliding groups' seats first, the rest to group 0
            num_blocks = (budget - max_num_seqs * seat_bytes) // bytes_per_block
            if num_blocks < max_num_seqs:  # fewer than max_num_seqs can run: each takes a block and a seat
                num_blocks = budget // (bytes_per_block + seat_bytes)
            if num_blocks < 1 and kv_cache_memory is None:
                num_blocks = 1
            if num_blocks < 1:
                raise ConfigError(f"kv_cache_memory {kv_cache_memory!r} holds no block of "
                                  f"{bytes_per_block + seat_bytes} bytes" + (
                                      " (a block of the full-attention layers and a sequence's sliding-window "
                                      "blocks)" if len(groups) > 1 else ""))
        seats = min(max_num_seqs, num_blocks)
        layouts = (GroupLayout(group_window(groups[0]), groups[0].layers, num_blocks, bytes_per_block),) + tuple(
            GroupLayout(group_window(g), g.layers, n * seats, size) for g, n, size in zip(groups[1:], per_seq,
                                                                                       sizes[1:]))
        policy = _engine_policy(kv_policy, config, max_model_len)
        if len(groups) > 1 and policy is not None:
            raise ConfigError(f"kv_policy {policy} on a model whose layers have different windows "
                              f"({', '.join(str(g.window or 'full') for g in layouts)}): the engine keeps each "
                              "layer type's own blocks (KV-cache groups) and runs no policy over them; leave "
                              "kv_policy unset")
        if policy is not None:
            need = _policy_blocks(policy, block_size)
            if need > num_blocks:
                raise ConfigError(f"kv_policy {policy} holds up to {need} blocks of {block_size} tokens at "
                                  f"once but the pool has {num_blocks}: give a smaller policy or more memory")
        return cls(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len,
                   enable_prefix_caching, kv_dtype, bytes_per_block, policy, layouts)


def _policy_blocks(policy: Policy | None, block_size: int) -> int:
    """Blocks a sequence under `policy` may hold at once: its budget, the chunk being written, and the kept
    prefix (sinks or n_keep) rounded to its own blocks."""
    if policy is None:
        return 0
    return math.ceil(policy.budget / block_size) + 1 + math.ceil(_prefix_rows(policy) / block_size)


def _prefix_rows(policy: Policy) -> int:
    return int(getattr(policy, "sinks", getattr(policy, "n_keep", 0)))


def _engine_policy(spec: object, config: Any, max_model_len: int) -> Policy | None:
    """The Policy `spec` names (a policy string or a Policy), checked for the paged engine; None: exact."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            policy = parse_policy(spec, max_model_len)
        except InputError as exc:
            raise ConfigError(f"kv_policy: {exc}") from None
        if policy is None:
            return None
    elif isinstance(spec, Policy):
        policy = spec
    else:
        raise ConfigError(f"kv_policy must be a policy string (e.g. 'sinks:4:60') or a Policy, got {spec!r}")
    if not isinstance(policy, ENGINE_POLICIES):
        raise ConfigError(f"kv_policy {policy} cannot run in the paged engine: it must keep a text prefix plus "
                          "a tail, as window:W, sinks:S:W and shift:KEEP[:BUDGET] do (kvlab/engine/kv_bounds.py)")
    if policy.budget > max_model_len:
        raise ConfigError(f"kv_policy {policy} holds {policy.budget} tokens but max_model_len is "
                          f"{max_model_len}")
    if isinstance(policy, AttentionSinks) and policy.sinks >= policy.window:
        raise ConfigError(f"kv_policy {policy}: {policy.sinks} sink tokens need a larger window than "
                          f"{policy.window} (StreamingLLM keeps a few sinks beside a long window)")
    if config.sliding_window:
        raise ConfigError(f"kv_policy {policy} on a sliding-window model (sliding_window "
                          f"{config.sliding_window}): the model already bounds what it attends to; "
                          "leave kv_policy unset")
    return policy
