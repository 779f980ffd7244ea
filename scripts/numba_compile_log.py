"""Where a cold test run's compile minutes go: a pytest plugin that times every numba compile.

    PYTHONPATH=scripts .venv/bin/python -m pytest -p numba_compile_log [tests ...]

Run it in a fresh clone (numba's disk cache is per checkout path, so a clone at a new path compiles
everything, as CI does). At the end it prints the kernels and the tests that spent the most seconds
compiling, counting only outermost compiles (a kernel's callees compile inside it), and with
NUMBA_COMPILE_LOG=path.json it writes every compile (kernel, argument types, seconds, nesting depth, test).
Under pytest-xdist (`-n 2`, as CI runs) each worker writes its records beside the controller's temporary
folder and the controller sums them, so the figures are CI's own.
Why it matters: every distinct argument-type mix of a kernel is a variant compiled apart (5-30 s for the
fused decode layers), so a test model with a type mix no other test uses costs CI that much again.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict

from numba.core import event

_records: list[dict] = []
_test: list[str | None] = [None]


class _Timer(event.Listener):
    """Times numba's "numba:compile" events (they nest: a callee compiles inside its caller)."""

    def __init__(self) -> None:
        self.started: list[float] = []

    def on_start(self, ev: event.Event) -> None:
        self.started.append(time.perf_counter())

    def on_end(self, ev: event.Event) -> None:
        seconds = time.perf_counter() - self.started.pop()
        data = ev.data or {}
        func = getattr(data.get("dispatcher"), "py_func", None)
        name = f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', '?')}"
        _records.append({"kernel": name, "args": str(data.get("args")), "seconds": seconds,
                         "depth": len(self.started), "test": _test[0]})


event.register("numba:compile", _Timer())


def pytest_runtest_setup(item) -> None:
    _test[0] = item.nodeid


def _records_folder(controller: int) -> str:
    """Where the xdist workers of the controller process `controller` leave their records."""
    return os.path.join(tempfile.gettempdir(), f"numba_compile_log.{controller}")


def pytest_sessionfinish(session) -> None:
    """An xdist worker has no terminal: it leaves its records for the controller (its parent process)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        folder = _records_folder(os.getppid())
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{worker}.json"), "w") as f:
            json.dump(_records, f)


def _worker_records() -> list[dict]:
    """The records the controller's workers left (their parent is this process)."""
    folder = _records_folder(os.getpid())
    if not os.path.isdir(folder):
        return []
    records: list[dict] = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            records.extend(json.load(f))
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return records


def pytest_terminal_summary(terminalreporter) -> None:
    _records.extend(_worker_records())
    outer = [r for r in _records if r["depth"] == 0]
    if path := os.environ.get("NUMBA_COMPILE_LOG"):
        with open(path, "w") as f:
            json.dump(_records, f)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_test: dict[str, float] = defaultdict(float)
    for r in outer:
        by_kernel[r["kernel"]][0] += 1
        by_kernel[r["kernel"]][1] += r["seconds"]
        by_test[str(r["test"])] += r["seconds"]
    write = terminalreporter.write_line
    write(f"numba compiles: {len(outer)} outermost, {sum(r['seconds'] for r in outer):.0f} s in all")
    for kernel, (count, seconds) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:12]:
        write(f"  {seconds:6.1f} s  {count:3d} variants  {kernel}")
    for test, seconds in sorted(by_test.items(), key=lambda kv: -kv[1])[:12]:
        write(f"  {seconds:6.1f} s  {test}")
