"""Compiled hot-path kernels (numba), each with a NumPy twin that tests compare it to.

The compiled backend is the default where numba imports; if it does not (no wheel for the platform, a
broken install), kvlab falls back to the NumPy reference path and says why in `UNAVAILABLE_REASON`.
`KVLAB_BACKEND=numpy` in the environment forces the reference path everywhere (CI can run both).
"""

from __future__ import annotations

import os

from kvlab.errors import InputError

BACKENDS = ("numba", "numpy")

# numba's OpenMP threads spin-wait between parallel regions by default. A decode step runs ~150 short
# regions; when another process holds one of two cores, spinning threads burn the time slices their
# partner needs and a step slowed ~20x (measured: 664 ms vs 34 ms for 30 bfloat16 gemvs on a loaded
# 2-core VM). Purely sleeping waits (PASSIVE) cost ~18 us to wake a thread per region, ~2 ms a step.
# A short spin (GOMP_SPINCOUNT 1000, ~microseconds) bridges the gap between one region and the next
# and then sleeps: measured on the 2-core VM, decode 11% faster than PASSIVE when quiet and 1.9x slower
# with a busy neighbour (PASSIVE 1.4x; a spin of 10000: 4.2x). Set before numba loads OpenMP; a user's
# own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from kvlab.kernels.cache_dir import install as _install_cache_dir  # noqa: E402

CACHE_DIR = _install_cache_dir()  # numba's disk cache, keyed on the kernels' source (cache_dir.py says why)

try:
    import numba  # noqa: F401
    AVAILABLE = True
    UNAVAILABLE_REASON = ""
except Exception as exc:  # ImportError, or an llvmlite that fails to load on this platform
    AVAILABLE = False
    UNAVAILABLE_REASON = f"numba could not be imported ({type(exc).__name__}: {exc})"

if AVAILABLE:
    # Start numba's thread pool now, before any kernel is loaded from the disk cache. A serial kernel that
    # calls a parallel one (qdecode_layer's fused calls around qgemv's products) carries the parallel
    # code's calls into the pool, but when it was compiled against a callee loaded from the cache numba
    # does not record that the pool must be started on load: loaded first in a fresh process, it called
    # address 0 (a segfault on the first int8-activation prefill; tests/test_kernel_cache_dir.py).
    numba.get_num_threads()


def resolve_backend(backend: str | None = None) -> str:
    """'numba' or 'numpy' for a requested backend: None/"auto" = compiled where available."""
    if backend in (None, "auto"):
        backend = os.environ.get("KVLAB_BACKEND", "auto").lower() or "auto"
        if backend == "auto":
            return "numba" if AVAILABLE else "numpy"
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}: choose 'auto', 'numba' or 'numpy'")
    if backend == "numba" and not AVAILABLE:
        raise InputError(f"backend 'numba' is not available: {UNAVAILABLE_REASON}")
    return backend


class CompileCounter:
    """How many functions numba compiled while it was installed (`with CompileCounter() as compiled:`).

    A kernel loaded from numba's disk cache is not compiled, so this tells a first run from a warm one;
    elapsed time cannot (a warm start under load took 1.6-4.1 s and was reported as a compile)."""

    def __init__(self) -> None:
        self.count = 0
        self._installed = None

    def __enter__(self) -> "CompileCounter":
        if AVAILABLE:
            from numba.core import event

            counter = self

            class _Listener(event.Listener):
                def on_start(self, ev: object) -> None:
                    counter.count += 1

                def on_end(self, ev: object) -> None:
                    pass

            self._installed = event.install_listener("numba:compile", _Listener())
            self._installed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed is not None:
            self._installed.__exit__(*exc)
            self._installed = None
