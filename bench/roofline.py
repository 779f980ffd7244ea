"""The memory roofline's denominator, measured in the same run as what it judges (FIELD-NOTES: the streaming
read on these VMs swings 33-57 GB/s from minute to minute, so only a same-round figure means anything)."""

from __future__ import annotations

import time

import numpy as np


def measure_bandwidth(repeats: int = 5) -> float:
    """Streaming-read bandwidth (bytes/s): a parallel sum over 512 MiB of float32, on the kernels' threads."""
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=True)
    def total(a):
        s = np.float32(0.0)
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    data = np.ones(128 * 1024 * 1024, dtype=np.float32)
    total(data)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(data)
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best
