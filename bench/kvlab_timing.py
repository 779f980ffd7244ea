"""kvlab's side of the decode benchmarks: one prefill, then timed decode steps, as every bench measures it."""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from kvlab.progress import KernelCompiles, compiling_kernels

_WARM: set[tuple[int, str | None]] = set()  # (id(model), kv_dtype) already warmed in this process


def kvlab_run(model, prompt: np.ndarray, steps: int, kv_dtype: str | None = None) -> tuple[float, float]:
    """(prefill seconds, median decode seconds per step) with kvlab's cache (kv_dtype: its storage, None =
    the model's dtype); prompt [B, T]. Each step feeds the argmax of the last one, as greedy generation does.
    The model is warmed first (numba's first-run compile is said on stderr, not timed), and any compile the
    warm-up missed is taken out of the time it fell in."""
    if (id(model), kv_dtype) not in _WARM:
        with compiling_kernels():
            model.warm_up(kv_dtype)
        _WARM.add((id(model), kv_dtype))
    cache = model.new_cache(prompt.shape[0], kv_dtype=kv_dtype, capacity=prompt.shape[1] + steps + 1)
    with KernelCompiles() as compiles:
        start = time.perf_counter()
        logits = model.forward(prompt, cache=cache, logits_to_keep=1).logits
        end = time.perf_counter()
        prefill = end - start - compiles.seconds_between(start, end)
        times = decode_step_times(model, cache, np.argmax(logits[:, -1], axis=-1)[:, None], steps, compiles)
    return prefill, statistics.median(times)


def decode_step_times(model, cache, token: np.ndarray, steps: int, compiles: KernelCompiles) -> list[float]:
    """Seconds of each of `steps` greedy decode steps from `token` [B, 1] on `cache`, compiles taken out."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model.forward(token, cache=cache, logits_to_keep=1).logits
        token = np.argmax(logits[:, -1], axis=-1)[:, None]
        end = time.perf_counter()
        times.append(end - start - compiles.seconds_between(start, end))
    return times


def step_bytes(model, context: int, batch: int = 1) -> int:
    """Bytes a kvlab decode step reads: every block matrix and the LM head once, as the model keeps them
    (float, half, or quantized codes + scales: each object's `nbytes`), plus the K/V cache of every
    sequence at `context` in the compute dtype (what the cache stores by default)."""
    c = model.config
    matrices = sum(value.nbytes for layer in model.layers
                   for value in (getattr(layer, f.name) for f in dataclasses.fields(layer))
                   if getattr(value, "ndim", 0) == 2)
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * np.dtype(model.dtype).itemsize
    return matrices + model.lm_head.nbytes + kv * batch
