"""What a user waiting on stderr is told: the bar while weights load (large models only), and a note while
numba compiles kvlab's kernels (first run only)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TextIO

PROGRESS_MIN_BYTES = 64 * 1024 * 1024  # show a progress bar for loads above this


@contextmanager
def weight_progress(total_bytes: int, progress: bool | None = None) -> Iterator[Callable[[int], None]]:
    """Yields `advance(nbytes)`; draws a transient bar when `progress` is True, or is None and the load is
    large. Why transient and on stderr: the bar must never mix into generated text on stdout."""
    show = total_bytes >= PROGRESS_MIN_BYTES if progress is None else progress
    if not show:
        yield lambda nbytes: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("loading weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("load", total=total_bytes)
        yield lambda nbytes: bar.advance(task, nbytes)


# numba compiles kvlab's kernels on first use and keeps them on disk (kvlab/kernels/cache_dir.py). Measured
# on 2 cores with an empty cache (`NUMBA_CACHE_DIR=$(mktemp -d) kvlab generate "x"`): the default model's
# warm-up compiled 88 functions in 27.0, 27.4 and 28.5 s on a quiet machine, 34.5 s (issue 32) and 50 s beside
# other work; serve's start-up 94 functions in 35.8 s.
COMPILE_ESTIMATE_SECONDS = 30


class KernelCompiles:
    """Watches numba's compiler while installed (`with KernelCompiles() as compiles:`): how many functions
    it compiled, when (so a timer can take compile time out of what it measured), and a note on `out` the
    moment the first compile starts.

    numba reports compiles as "numba:compile" events and sends none for kernels loaded from its disk cache
    (0 events on a warm start, ~90 cold), so a warm start says nothing; elapsed time could not tell them
    apart (a warm start under load took 1.6-4.1 s)."""

    def __init__(self, out: TextIO | None = None, estimate: float = COMPILE_ESTIMATE_SECONDS,
                 prefix: str = "") -> None:
        self.count = 0
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each outermost compile
        self.out, self.estimate, self.prefix = out, estimate, prefix
        self._installed: Any = None

    @property
    def seconds(self) -> float:
        """Wall time spent inside numba's compiler (a kernel's callees compile inside it: counted once)."""
        return sum(end - start for start, end in self.intervals)

    def seconds_between(self, start: float, end: float) -> float:
        """Compile time inside [start, end] (time.perf_counter values)."""
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.intervals)

    def notice(self) -> str:
        return (f"{self.prefix}compiling kernels (first run only, ~{self.estimate:.0f} s; numba keeps them on "
                "disk for later runs)...")

    def done(self) -> str:
        return f"{self.prefix}kernels compiled in {self.seconds:.1f} s ({self.count} functions)"

    def start(self) -> "KernelCompiles":
        """Install the watcher (what `with` does); `stop()` removes it."""
        return self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def __enter__(self) -> "KernelCompiles":
        from kvlab.kernels import AVAILABLE

        if not AVAILABLE:
            return self
        from numba.core import event

        watch, depth, started = self, [0], [0.0]

        class _Listener(event.Listener):
            def on_start(self, ev: object) -> None:
                watch.count += 1
                if watch.count == 1 and watch.out is not None:
                    print(watch.notice(), file=watch.out, flush=True)
                if depth[0] == 0:
                    started[0] = time.perf_counter()
                depth[0] += 1

            def on_end(self, ev: object) -> None:
                depth[0] -= 1
                if depth[0] == 0:
                    watch.intervals.append((started[0], time.perf_counter()))

        self._installed = event.install_listener("numba:compile", _Listener())
        self._installed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed is not None:
            self._installed.__exit__(*exc)
            self._installed = None
            if self.count and self.out is not None:
                print(self.done(), file=self.out, flush=True)


def compiling_kernels(prefix: str = "", out: TextIO | None = None) -> KernelCompiles:
    """`with compiling_kernels():` around a warm-up: says on stderr that kernels are compiling (first run
    only, with an estimate) and how long it took; says nothing when numba loads them from its disk cache."""
    return KernelCompiles(out if out is not None else sys.stderr, prefix=prefix)
