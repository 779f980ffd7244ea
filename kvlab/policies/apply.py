"""Running a model under a cache policy: make room before each forward, split long inputs to fit.

Positions: kept rows are re-rotated to positions 0..n-1 (their place in the cache), never left at their
positions in the text. Why:

* the model's contract stays as it is: new positions start at num_cached_tokens (ARCHITECTURE.md invariant 4) and
  the mask is built from the cache's absolute positions, which are then plain 0..T-1 (one run of keys
  per query, which the compiled kernels take);
* positions never pass the budget, so a model with a 256-token context can run forever (llama.cpp's
  context shift, `kvlab generate -n 2000 --context-shift`); stored position ids would grow past
  max_position_embeddings;
* for a sliding window it changes nothing but rounding: every kept key and the next query move by the same
  delta, and RoPE scores depend only on the distance between query and key;
* for sinks it is what StreamingLLM prescribes (positions within the cache), and for a context shift what
  llama.cpp does.

The cost is one rotation of every kept key per eviction (cheap next to a forward for a float cache). A
quantized cache must dequantize, rotate and re-quantize (as llama.cpp's K-shift does for quantized K), so
each eviction adds one rounding to every kept key; fidelity measures what that costs.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from kvlab.cache.kv_cache import KVCache
from kvlab.errors import InputError
from kvlab.model.llama import LlamaModel
from kvlab.policies.base import Policy
from kvlab.policies.shift import rerotate_keys


def check_policy(model: LlamaModel, policy: Policy) -> None:
    """A budget must fit the model's positions: rows sit at 0..budget-1."""
    context = model.config.max_position_embeddings
    if policy.budget > context:
        raise InputError(f"{policy} holds {policy.budget} tokens but the model's context is {context} "
                         "tokens (max_position_embeddings)")


def make_room(model: LlamaModel, cache: KVCache, policy: Policy, num_new: int) -> int:
    """Evict so that `num_new` more rows fit the policy's budget; returns how many rows were dropped."""
    if not 1 <= num_new <= policy.max_chunk:
        raise InputError(f"{policy} can take 1..{policy.max_chunk} new tokens per forward, got {num_new}")
    length = cache.get_seq_length()
    if length + num_new <= policy.budget:
        return 0
    rows = policy.keep(length, num_new)
    cache.retain(rows, np.arange(rows.size), rotate_keys=partial(rerotate_keys, inv_freq=model.inv_freq))
    return length - int(rows.size)


def forward_with_policy(model: LlamaModel, ids: Any, cache: KVCache, policy: Policy,
                        logits_to_keep: int = 0) -> np.ndarray:
    """`model.forward(ids, cache)` under `policy`: ids [B, T] go in chunks of at most `max_chunk` tokens,
    each after `make_room`. Returns logits [B, T or logits_to_keep, vocab]."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise InputError(f"ids must be a non-empty [batch, tokens] array, got shape {ids.shape}")
    check_policy(model, policy)
    size, outputs = policy.max_chunk, []
    for start in range(0, ids.shape[1], size):
        part = ids[:, start:start + size]
        keep = min(logits_to_keep, part.shape[1]) if logits_to_keep else 0
        make_room(model, cache, policy, part.shape[1])
        outputs.append(model.forward(part, cache=cache, logits_to_keep=keep, observer=policy.observe).logits)
    logits = outputs[0] if len(outputs) == 1 else np.concatenate(outputs, axis=1)
    return logits[:, -logits_to_keep:] if logits_to_keep else logits
