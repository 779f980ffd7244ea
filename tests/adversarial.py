"""Shared checks for the adversarial suites (test_adversarial_*.py), and the tally they report.

Each bad input is tried through one of these helpers, which asserts the promise kvlab makes for it: the
API raises a KVLabError subclass; the CLI exits non-zero with exactly one line on stderr and no traceback;
and in both cases caches, sessions and files are exactly as before. `TALLY` counts inputs tried and inputs
handled cleanly; conftest.py prints it at the end of the run (the goal: the two are equal). `SERVER_TALLY`
does the same for hostile HTTP requests (test_adversarial_server.py): each is answered with the expected
4xx in OpenAI's error shape, never a 5xx, and the server is healthy and its pool balanced after.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from kvlab.errors import KVLabError

TALLY = {"tried": 0, "clean": 0}
SERVER_TALLY = {"tried": 0, "clean": 0}   # hostile HTTP requests (test_adversarial_server.py)


def refuses(call: Callable[[], Any], error: type[BaseException] = KVLabError, match: str | None = None
            ) -> BaseException:
    """`call()` raises `error` (a KVLabError subclass by default); counted in the tally."""
    TALLY["tried"] += 1
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, KVLabError), f"{type(info.value).__name__} is not a KVLabError"
    TALLY["clean"] += 1
    return info.value


def cache_state(cache: Any) -> tuple:
    """Everything observable about a KVCache: length, positions, capacity and the bytes of every row."""
    digest = hashlib.sha256()
    for keys, values in cache:
        digest.update(np.ascontiguousarray(keys).tobytes())
        digest.update(np.ascontiguousarray(values).tobytes())
    return (cache.get_seq_length(), cache.positions.tolist(), cache.store.capacity_tokens, cache.dtype.name,
            digest.hexdigest())


def tree_state(root: Path) -> dict[str, Any]:
    """Every entry under `root`: file bytes (hashed), symlink targets, folders; without following links."""
    state: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                state[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                state[rel] = ("dir",)
            else:
                state[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return state


def run_cli(argv: list[str], capsys: Any, monkeypatch: Any, stdin: bytes | None = None) -> tuple[int, str, str]:
    """`kvlab.cli.main(argv)` in this process with `stdin` as its standard input; (code, stdout, stderr)."""
    from kvlab.cli import main

    raw = io.BytesIO(b"" if stdin is None else stdin)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(raw, encoding="utf-8"))
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own exits (our Parser prints one line first)
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# a cold numba cache announces its compile before the command gets to refuse (issue 32 item 3): progress, not error
COMPILE_NOTE = re.compile(r"compiling kernels \(first run only|kernels compiled in [0-9.]+ s")


def cli_refuses(argv: list[str], capsys: Any, monkeypatch: Any, stdin: bytes | None = None,
                watch: Path | None = None, match: str | None = None) -> str:
    """The CLI refuses `argv`: exit code != 0, one line on stderr, no traceback, `watch` unchanged."""
    TALLY["tried"] += 1
    before = tree_state(watch) if watch is not None else None
    code, _, err = run_cli(argv, capsys, monkeypatch, stdin)
    lines = [line for line in err.strip("\n").splitlines() if not COMPILE_NOTE.search(line)]
    if lines and lines[0].startswith("usage: kvlab "):  # an unknown flag: that command's usage first (issue 32)
        end = 1
        while end < len(lines) and lines[end].startswith(" "):  # the usage's continuation lines
            end += 1
        lines = lines[end:]
    assert code != 0, f"kvlab {argv} exited 0; stderr: {err!r}"
    assert len(lines) == 1, f"kvlab {argv}: expected one stderr line, got {lines!r}"
    assert "Traceback" not in err and "error" in lines[0], err
    assert "unexpected error" not in lines[0], f"kvlab {argv}: not handled, only caught: {lines[0]}"
    if match is not None:
        assert match in lines[0], (match, lines[0])
    if watch is not None:
        assert tree_state(watch) == before, f"kvlab {argv} changed files under {watch}"
    TALLY["clean"] += 1
    return lines[0]
