"""`generate` / `stream_generate`: a batch of prompts over one KVCache, without the engine.

The loop is kvlab/generation/loop.py's DecodeLoop (prefill once, then one token per step from the cache);
this module checks the arguments and supplies the step. `stream_generate` yields each step's tokens as they
are chosen; `generate` collects them. With `use_cache=False` every step recomputes the whole prefix instead
(same tokens, for comparison).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from kvlab import validate
from kvlab.cache.dtypes import resolve_kv_dtype
from kvlab.cache.kv_cache import KVCache, new_cache
from kvlab.sampling.sampler import Sampler, SamplingParams
from kvlab.errors import ContextLengthError, InputError
from kvlab.generation.loop import DecodeLoop
from kvlab.model.llama import LlamaModel, validate_ids


def stream_generate(model: LlamaModel, ids: Any, max_new_tokens: int | None = None, *,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed: int | None = None, stop_token_ids: Iterable[int] = (),
                    pad_token_id: int | None = None, use_cache: bool = True,
                    cache: KVCache | None = None, kv_dtype: object = None,
                    grammar: Any = None) -> DecodeLoop:
    """Yield a [B] array of token ids per step.

    `ids` [B, T] is the prompt (with a `cache`, only the positions after it). A row that emits one of
    `stop_token_ids` is finished: later steps give it `pad_token_id` (default: the first stop id) and the
    loop ends when every row is finished or `max_new_tokens` (None = to the end of the context) is reached.
    The last token chosen is not fed back, so the cache ends holding every position but that one.
    This is the plain reference loop; cache policies (window, sinks, context shift) run in the engine
    (`Engine(model, kv_policy=...)`, `kvlab generate --cache-policy`).
    """
    ids = validate_ids(ids, model.config.vocab_size)
    params = SamplingParams(temperature, top_k, top_p, min_p, seed, grammar=grammar)  # grammar: every row
    vocab = model.config.vocab_size
    stop = np.array(sorted(set(validate.token_ids(stop_token_ids, "stop_token_ids", vocab))), dtype=np.int64)
    pad = validate.optional_int(pad_token_id, "pad_token_id", 0, vocab - 1)
    pad = (int(stop[0]) if stop.size else 0) if pad is None else pad
    if not isinstance(use_cache, bool):
        raise InputError(f"use_cache must be True or False, got {use_cache!r}")
    if kv_dtype is not None:
        resolve_kv_dtype(kv_dtype, model.dtype)  # an unknown name fails now, not at the first step
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise InputError(f"cache must be a KVCache, got {type(cache).__name__}")
        if not use_cache:
            raise InputError("cache= was given with use_cache=False: the cache would be ignored and every step "
                             "recomputed from position 0; drop one of them")
        if kv_dtype is not None and resolve_kv_dtype(kv_dtype, cache.spec.compute_dtype) != cache.dtype:
            raise InputError(f"kv_dtype={kv_dtype!r} but the given cache stores {cache.dtype.name}")
        cache.check_compatible(model.cache_spec, ids.shape[0])
    start = cache.get_seq_length() if cache is not None else 0
    context = model.config.max_position_embeddings
    room = context - start - ids.shape[1]
    if max_new_tokens is None:
        max_new_tokens = room + 1  # the last chosen token needs no position of its own
    max_new_tokens = validate.int_in_range(max_new_tokens, "max_new_tokens", 0)
    if room < 0 or max_new_tokens - 1 > room:
        raise ContextLengthError(
            f"{start + ids.shape[1]} prompt tokens + {max_new_tokens} new tokens exceed the model's "
            f"context of {context} tokens (max_position_embeddings)")
    if max_new_tokens == 0:
        return DecodeLoop(lambda tokens: np.zeros(0), Sampler(params), 0, stop, pad=pad)
    if use_cache and cache is None:
        capacity = start + ids.shape[1] + max_new_tokens
        if model.config.hybrid:  # its own cache: sliding layers keep only their window
            cache = new_cache(model.cache_spec, ids.shape[0], kv_dtype, capacity,
                              windows=[model.config.layer_window(i) for i in range(model.config.num_hidden_layers)])
        else:
            cache = model.new_cache(ids.shape[0], kv_dtype, capacity)
    # Everything above runs at call time, so bad arguments raise here, not at the first next().
    return DecodeLoop(_step(model, ids, use_cache, cache), Sampler(params), int(max_new_tokens), stop,
                      pad=pad, room=room + 1)


def _step(model: LlamaModel, ids: np.ndarray, use_cache: bool,
          cache: KVCache | None) -> Callable[[np.ndarray | None], np.ndarray]:
    """The loop's step: the prompt (tokens None) or one new token per row, to the last position's logits."""
    sequence = [ids]

    def step(tokens: np.ndarray | None) -> np.ndarray:
        step_input = ids if tokens is None else tokens
        if use_cache:
            return model.forward(step_input, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        if tokens is not None:
            sequence[0] = np.concatenate([sequence[0], tokens], axis=1)
        return model.forward(sequence[0], logits_to_keep=1).logits[:, -1]

    return step


def generate(model: LlamaModel, ids: Any, max_new_tokens: int | None = None, **kwargs: Any) -> np.ndarray:
    """The new token ids only, [B, n]; see `stream_generate` for the arguments."""
    ids = validate_ids(ids, model.config.vocab_size)
    steps = list(stream_generate(model, ids, max_new_tokens, **kwargs))
    if not steps:
        return np.zeros((ids.shape[0], 0), dtype=np.int64)
    return np.stack(steps, axis=1)
