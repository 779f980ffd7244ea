"""Give freed heap memory back to the operating system after a model is built.

Loading a GGUF file unpacks and tiles every matrix through temporaries of a few MiB to tens of MiB; glibc's
malloc serves most of them from its heap (its mmap threshold rises to 32 MiB after the first large free)
and keeps what they free, interleaved with the weights, as part of the process's resident memory: 0.5 GiB
of a 1.5 GiB process after loading a 1B-parameter Q4_0 file (bench/bench_memory.py). `malloc_trim(0)`
returns the free pages inside the heap, not only its top. A no-op where the C library has no malloc_trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import lru_cache


@lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_free_memory() -> bool:
    """Collect garbage and return free heap pages to the OS; True when malloc_trim ran."""
    gc.collect()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
