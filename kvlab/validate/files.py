"""Paths and files a user names: path text, existing files and folders, UTF-8 text and JSON objects read from disk.

Why apart from the value checkers (kvlab/validate/values.py): these touch the file system, and every reader
refuses what it cannot read (a folder for a file, a loop, binary data, NaN in JSON) naming the path, before
any caller acts on the content. `error` is the caller's error class, as in values.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvlab.errors import InputError, KVLabError


def path_text(path: Any, name: str, error: type[KVLabError] = InputError) -> str:
    """A path as text: a str or os.PathLike, not empty, without NUL bytes, valid UTF-8."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise error(f"{name} must be a path, got {type(path).__name__} {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\0" in text:
        raise error(f"{name} {text!r} is not a valid path")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{name} {text!r} is not valid UTF-8") from None
    return text


def existing_path(path: Any, name: str, *, kind: str = "file", error: type[KVLabError] = InputError) -> Path:
    """A path that exists and is a file (kind="file"), a folder (kind="dir") or either (kind="any").

    Refuses, naming the path: non-path values, NUL bytes, missing paths, symlink loops, a folder where a
    file is expected and the reverse.
    """
    result = Path(path_text(path, name, error)).expanduser()
    try:
        result.resolve(strict=True)
        is_dir = result.is_dir()
    except FileNotFoundError:
        what = "folder" if kind == "dir" else "file"
        raise error(f"{result}: {what} not found" + ("" if name == result.name else f" (the {name})")) from None
    except RuntimeError:  # Python 3.11 reports symlink loops this way
        raise error(f"{result}: symlink loop") from None
    except OSError as exc:
        if exc.errno == 40:  # ELOOP
            raise error(f"{result}: symlink loop") from None
        raise error(f"{result}: {exc.strerror or exc}") from None
    if kind == "file" and is_dir:
        raise error(f"{result}: is a folder; the {name} must be a file")
    if kind == "dir" and not is_dir:
        raise error(f"{result}: is a file; the {name} must be a folder")
    return result


def read_text(path: Any, name: str = "text file", error: type[KVLabError] = InputError) -> str:
    """The UTF-8 text of a file; refuses binary files (NUL bytes or invalid UTF-8) naming the offset."""
    file = existing_path(path, name, kind="file", error=error)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise error(f"{file}: cannot read ({exc.strerror or exc})") from None
    return decode_text(data, str(file), error)


def decode_text(data: bytes, what: str, error: type[KVLabError] = InputError) -> str:
    """`data` as UTF-8 text; binary data (a NUL byte, or bytes that are not UTF-8) is refused."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise error(f"{what}: binary data, not text (NUL byte at offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def read_json_object(path: Any, name: str = "JSON file", error: type[KVLabError] = InputError) -> dict[str, Any]:
    """A JSON object from a text file; NaN/Infinity literals are refused (they are not JSON)."""
    text = read_text(path, name, error)
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")
