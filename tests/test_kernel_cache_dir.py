"""numba's disk cache goes in a folder keyed on the kernels' source (kvlab/kernels/cache_dir.py), because
numba's own check sees only the compiled function's file: an edit to a module it inlined left stale
machine code in use (a segfault after an upgrade)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvlab.kernels import cache_dir

pytest.importorskip("numba")


def _write_package(folder: Path, value: int) -> None:
    """dep.py holds a function inlined into main.py's cached kernel."""
    folder.mkdir(exist_ok=True)
    (folder / "dep.py").write_text(textwrap.dedent(f"""
        from numba import njit

        @njit(inline="always")
        def answer():
            return {value}
    """))
    (folder / "main.py").write_text(textwrap.dedent("""
        from numba import njit
        from dep import answer

        @njit(cache=True)
        def kernel():
            return answer()
    """))


def _run_kernel(package: Path, numba_cache: Path) -> int:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba_cache), "PYTHONPATH": str(package)}
    out = subprocess.run([sys.executable, "-c", "import main; print(main.kernel())"], env=env,
                         capture_output=True, text=True, check=True, timeout=300)
    return int(out.stdout.split()[-1])


def test_numba_alone_keeps_stale_code_after_an_inlined_module_changes(tmp_path):
    """The hazard itself, so that the day numba checks dependencies this test says the key is no longer
    needed: main.py unchanged, dep.py changed, and the cached kernel still answers the old value."""
    package, numba_cache = tmp_path / "pkg", tmp_path / "cache"
    _write_package(package, 1)
    assert _run_kernel(package, numba_cache) == 1
    _write_package(package, 2)
    assert _run_kernel(package, numba_cache) == 1  # stale: numba checked main.py only


def test_a_folder_keyed_on_the_source_compiles_afresh_after_any_change(tmp_path):
    package, base = tmp_path / "pkg", tmp_path / "cache"
    _write_package(package, 1)
    first = cache_dir.cache_dir(cache_dir.source_key(package), {"NUMBA_CACHE_DIR": str(base)})
    assert _run_kernel(package, first) == 1
    _write_package(package, 2)
    second = cache_dir.cache_dir(cache_dir.source_key(package), {"NUMBA_CACHE_DIR": str(base)})
    assert second != first and second.parent == first.parent == base
    assert _run_kernel(package, second) == 2


def test_source_key_follows_every_file_and_nothing_else(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    key = cache_dir.source_key(tmp_path)
    assert len(key) == 16 and cache_dir.source_key(tmp_path) == key
    (tmp_path / "notes.txt").write_text("not source")
    assert cache_dir.source_key(tmp_path) == key
    (tmp_path / "a.py").write_text("x = 2\n")
    changed = cache_dir.source_key(tmp_path)
    assert changed != key
    (tmp_path / "b.py").write_text("")
    assert cache_dir.source_key(tmp_path) not in (key, changed)
    (tmp_path / "b.py").unlink()
    (tmp_path / "c.py").write_text("x = 2\n")
    (tmp_path / "a.py").unlink()
    assert cache_dir.source_key(tmp_path) != changed  # same bytes under another name


def test_the_folder_goes_under_the_users_numba_cache_dir_or_the_xdg_cache(tmp_path):
    key = "0123456789abcdef"
    assert cache_dir.cache_dir(key, {"NUMBA_CACHE_DIR": str(tmp_path)}) == tmp_path / f"kvlab-{key}"
    ours = tmp_path / f"kvlab-{key}"  # a child process inherits the folder its parent set: no nesting
    assert cache_dir.cache_dir(key, {"NUMBA_CACHE_DIR": str(ours)}) == ours
    assert cache_dir.cache_dir(key, {"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "kvlab" / "numba" / f"kvlab-{key}"
    assert cache_dir.cache_dir(key, {}) == Path.home() / ".cache" / "kvlab" / "numba" / f"kvlab-{key}"


def test_importing_kvlab_points_numba_at_the_keyed_folder(tmp_path):
    """In a fresh process: numba's config and the environment name the folder for kvlab/kernels' key,
    and a cached kernel of kvlab's is written there."""
    code = textwrap.dedent("""
        import os, numba
        import kvlab.kernels
        from kvlab.kernels import cache_dir, gemv
        import numpy as np
        gemv.matvec_block(np.ones((1, 8), np.float32), np.ones((8, 8), np.float32), np.empty((1, 8), np.float32),
                          np.float32(0), 0, 8)
        print(numba.config.CACHE_DIR)
        print(os.environ["NUMBA_CACHE_DIR"])
        print(cache_dir.source_key())
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=300).stdout.split()
    config_dir, env_dir, key = out[-3:]
    assert config_dir == env_dir == str(tmp_path / f"kvlab-{key}")
    assert any(p.suffix == ".nbi" for p in Path(config_dir).rglob("*")), "no numba index written there"


_SERIAL_AROUND_PARALLEL = """
from numba import njit, prange

@njit(parallel=True, cache=True)
def inner(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0

@njit(cache=True)
def outer(a):
    inner(a)
    return a.sum()
"""


def _run(package: Path, numba_cache: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(numba_cache), "PYTHONPATH": str(package)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("start_pool", [False, True])
def test_a_serial_kernel_around_a_parallel_one_loads_from_the_cache(tmp_path, start_pool):
    """numba's hazard, and kvlab's answer to it: `outer` (serial) is compiled in a process that loaded
    `inner` (parallel) from the cache, then loaded first in a fresh process. Without the thread pool
    started it calls address 0 and the process dies of SIGSEGV; importing kvlab.kernels starts the pool
    first, and the same cache then runs. (The day numba records the pool for such callers, the first case
    stops crashing and this test says so.)"""
    package = tmp_path / "pkg"
    numba_cache = tmp_path / f"kvlab-{cache_dir.source_key()}"  # kvlab's own name: importing it keeps it
    package.mkdir()
    (package / "toy.py").write_text(_SERIAL_AROUND_PARALLEL)
    for code in ("import numpy as np, toy; toy.inner(np.zeros(8))",  # compiles inner into the cache
                 "import numpy as np, toy; toy.inner(np.zeros(8)); print(toy.outer(np.zeros(8)))"):
        done = _run(package, numba_cache, code)
        assert done.returncode == 0, done.stderr
    first = "import kvlab.kernels; " if start_pool else ""
    done = _run(package, numba_cache, first + "import numpy as np, toy; print(toy.outer(np.zeros(8)))")
    assert len(list(numba_cache.rglob("toy.outer*.nbc"))) == 1  # loaded, not compiled afresh
    if start_pool:
        assert done.returncode == 0 and done.stdout.split() == ["8.0"], done.stderr
    else:
        assert done.returncode == -11, (done.returncode, done.stdout, done.stderr)  # SIGSEGV
