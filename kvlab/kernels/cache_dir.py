"""Where numba keeps kvlab's compiled kernels: a folder named after the kernels' source, so an edit or an
upgrade can never load stale machine code.

numba's disk cache checks only the source file of the function it compiled (its mtime and size). A
kernel that inlines code from another module (qdecode_layer.py inlines qgemv.py's tiles, which call
qdot.py's LLVM intrinsics) keeps its cached machine code when that other module changes: after an
upgrade the stale code ran against the new operand layout and crashed the process (seen here: a
segfault in the int8-activation products after qdot.py changed its scale layout). Keying the folder on a
hash of every kernel source makes any change compile afresh, in a new folder.

The base is `NUMBA_CACHE_DIR` when the user set it, else `$XDG_CACHE_HOME/kvlab/numba` (~/.cache); the
key folder goes under it. Set before numba compiles anything, in this process (numba.config) and in the
environment, which numba re-reads during compiles and child processes inherit.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parent
PREFIX = "kvlab-"


def source_key(folder: Path = KERNELS) -> str:
    """16 hex digits of the sha256 over every .py file of `folder` (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def default_base(environ: dict | os._Environ = os.environ) -> Path:
    """The per-user cache folder kvlab's kernels go under when NUMBA_CACHE_DIR is not set."""
    xdg = environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvlab" / "numba"


def cache_dir(key: str, environ: dict | os._Environ = os.environ) -> Path:
    """The folder for kernels whose source has `key`: under the user's NUMBA_CACHE_DIR if set (left as it
    is when it already is kvlab's folder for this key: a child process of one that set it), else under
    `default_base`."""
    user = environ.get("NUMBA_CACHE_DIR", "")
    if user and Path(user).name == PREFIX + key:
        return Path(user)
    return (Path(user) if user else default_base(environ)) / (PREFIX + key)


def install(environ: dict | os._Environ = os.environ) -> Path:
    """Point numba's disk cache at `cache_dir(source_key())`, before any kernel module is imported."""
    folder = cache_dir(source_key(), environ)
    environ["NUMBA_CACHE_DIR"] = str(folder)
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba already imported (by the user, or by us just before)
        config.CACHE_DIR = str(folder)
    return folder
