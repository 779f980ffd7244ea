"""One checker per kind of value a user hands kvlab: numbers, seeds, token ids, text, byte sizes, JSON data.

Why one place: the CLI, the Python API, the engine and the server all take the same kinds of value, and a
value that one entry point refuses must not slip through another. Each checker returns the value in its
canonical Python type (a float, an int, a list of ints, a Path, ...) or raises InputError naming the value
(`name`) and what was wrong. Callers that own a more specific error class pass it as `error` (a config
loader raises ConfigError, a checkpoint reader CheckpointError). Nothing here mutates anything, so every
entry point can validate all of its arguments first and only then change state.

Bools are refused where a number is expected (`True` is an int in Python, but never what a user meant),
and so are NaN, infinities and, for floats that scale something, subnormals (`temperature=1e-310` would
overflow every logit to inf).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable

import numpy as np

from kvlab.errors import InputError, KVLabError

RANDOM_SEED = -1  # llama.cpp's `--seed -1`: draw a fresh seed
MAX_SEED = 2**64 - 1


def is_int(value: Any) -> bool:
    """An int or NumPy integer, not a bool (duck-typed so this module needs no NumPy import)."""
    if isinstance(value, int):
        return not isinstance(value, bool)
    return getattr(getattr(value, "dtype", None), "kind", "") in ("i", "u") and getattr(value, "ndim", 1) == 0


def is_real(value: Any) -> bool:
    """A Python/NumPy int or float (not a bool, complex, string or array)."""
    if is_int(value):
        return True
    if isinstance(value, float):
        return True
    return getattr(getattr(value, "dtype", None), "kind", "") == "f" and getattr(value, "ndim", 1) == 0


def finite_float(value: Any, name: str, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, error: type[KVLabError] = InputError
                 ) -> float:
    """`value` as a finite float within [low, high] (an open end when `low_open` / `high_open`)."""
    if not is_real(value):
        raise error(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise error(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(number):
        raise error(f"{name} must be a finite number, got {number!r}")
    if low is not None and (number < low or (low_open and number == low)):
        raise error(f"{name} must be {'>' if low_open else '>='} {low}, got {number!r}")
    if high is not None and (number > high or (high_open and number == high)):
        raise error(f"{name} must be {'<' if high_open else '<='} {high}, got {number!r}")
    return number


def positive_float(value: Any, name: str, error: type[KVLabError] = InputError) -> float:
    """A finite float > 0 that is not subnormal: safe to divide by and to scale with."""
    number = finite_float(value, name, low=0.0, low_open=True, error=error)
    if number < 2.2250738585072014e-308:  # sys.float_info.min: below it, 1/x overflows
        raise error(f"{name} must be a normal positive number, got {number!r} (subnormal)")
    return number


def int_in_range(value: Any, name: str, low: int | None = None, high: int | None = None,
                 error: type[KVLabError] = InputError) -> int:
    """`value` as a Python int in [low, high] (either end may be None = unbounded); bools refused."""
    if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        got = repr(value) if is_int(value) else f"{type(value).__name__} {value!r}"
        raise error(f"{name} must be {_int_range(low, high)}, got {got}")
    return int(value)


def _int_range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an int in [{low}, {high}]"
    if low == 1:
        return "a positive int"
    if low == 0:
        return "a non-negative int"
    return "an int" + (f" >= {low}" if low is not None else "") + (f" <= {high}" if high is not None else "")


def positive_int(value: Any, name: str, error: type[KVLabError] = InputError) -> int:
    """`value` as a Python int >= 1 (sizes and counts: blocks, layers, tokens per step); bools refused."""
    return int_in_range(value, name, 1, None, error)


def optional_int(value: Any, name: str, low: int | None = None, high: int | None = None,
                 error: type[KVLabError] = InputError) -> int | None:
    return None if value is None else int_in_range(value, name, low, high, error)


def seed(value: Any, name: str = "seed", allow_random: bool = True) -> int | None:
    """A sampling seed: an int in [0, 2**64), or None / -1 (llama.cpp's "random seed") = None."""
    if value is None and allow_random:
        return None
    number = int_in_range(value, name, RANDOM_SEED if allow_random else 0, MAX_SEED)
    return None if number == RANDOM_SEED else number


def token_ids(value: Any, name: str, vocab_size: int | None = None, *, allow_single: bool = True,
              allow_empty: bool = True) -> list[int]:
    """A flat list of token ids in [0, vocab_size). A lone int is one id (as HF's `eos_token_id`)."""
    if allow_single and is_int(value):
        value = [value]
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable) or is_real(value):
        raise InputError(f"{name} must be a list of token ids (ints), got {type(value).__name__} {value!r}")
    checked = None  # what the range check reads: the NumPy array itself when one came in
    if getattr(value, "ndim", None) == 1 and getattr(value.dtype, "kind", "") in ("i", "u"):
        ids, checked = value.tolist(), value  # a NumPy int array: its items need no type check
    else:
        ids = []
        for i, item in enumerate(value):
            if not is_int(item):
                raise InputError(f"{name}[{i}] must be an int token id, got {type(item).__name__} {item!r}")
            ids.append(int(item))
    if not ids and not allow_empty:
        raise InputError(f"{name} is empty")
    outside = out_of_vocab(ids if checked is None else checked, vocab_size)
    if outside is not None:
        token, (i,) = outside
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InputError(f"{name}[{i}] = {token} is outside the vocabulary {bound}")
    return ids


def out_of_vocab(ids: Any, vocab_size: int | None) -> tuple[int, tuple[int, ...]] | None:
    """The first token id (in row-major order) outside [0, vocab_size) (below 0 when vocab_size is None)
    and its index, or None: the one range check behind the model's, the engine's, the sessions' and the
    server's refusals, each of which words its own message."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        array = ids
    else:
        try:
            array = np.asarray(ids, dtype=np.int64)
        except OverflowError:   # a Python int past int64 (JSON ints are unbounded) is outside any vocabulary
            for i, token in enumerate(ids):
                if token < 0 or (vocab_size is not None and token >= vocab_size):
                    return int(token), (i,)
            return None
    if array.size == 0:
        return None
    bad = array < 0 if vocab_size is None else (array < 0) | (array >= vocab_size)
    if not bad.any():
        return None
    where = np.unravel_index(int(np.argmax(bad)), array.shape)
    return int(array[where]), tuple(int(i) for i in where)


def text(value: Any, name: str = "text") -> str:
    """A str that is valid Unicode text (lone surrogates, e.g. undecodable bytes smuggled in from argv or
    a file read with errors="surrogateescape", cannot be encoded and are refused)."""
    if not isinstance(value, str):
        raise InputError(f"{name} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{name} is not valid Unicode text ({exc.reason} at position {exc.start})") from None
    return value


def compute_dtype(value: Any, error: type[KVLabError] = InputError) -> Any:
    """The NumPy dtype a model computes in: float32 or float64 (names, NumPy dtypes or types)."""
    import numpy as np

    try:
        dtype = np.dtype(value)
    except TypeError:
        raise error(f"compute dtype must be float32 or float64, got {value!r}") from None
    if dtype not in (np.float32, np.float64):
        raise error(f"compute dtype must be float32 or float64, got {dtype}")
    return dtype


# --- byte sizes -----------------------------------------------------------------------------------------
_SIZE_UNITS = {"": 1, "b": 1,
               "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "t": 1000**4, "tb": 1000**4,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: Any, name: str = "size") -> int:
    """A byte count from '64MiB', '8 GiB', '512MB', '1e9' or 1000000.

    Binary units KiB/MiB/GiB/TiB are powers of 1024 (how memory is allocated); decimal KB/MB/GB/TB (and
    bare K/M/G/T) are powers of 1000 (how disks and clouds sell it). Units are case-insensitive. The result
    must be a finite, non-negative whole number of bytes that fits an int64; fractions round down.
    """
    if is_int(text):
        return int_in_range(text, name, 0, 2**63 - 1)
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise InputError(f"cannot read {name} {text!r} as a byte count (try 8GiB, 512MB or 1000000)")
    number = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if not math.isfinite(number) or number >= 2**63:
        raise InputError(f"{name} {text!r} is too large (more than 2**63 bytes)")
    return int(number)


def json_dict(value: Any, name: str) -> dict[str, Any]:
    """A dict that survives a JSON round trip unchanged: string keys, finite numbers, lists not tuples.

    Why so strict: data saved now must load back as the same value; a tuple that comes back a list, an int
    key that comes back a string or a NaN that cannot be written at all are refused before anything is saved.
    """
    if not isinstance(value, dict):
        raise InputError(f"{name} must be a dict, got {type(value).__name__}")
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{name} must be JSON data ({exc})") from None
    if json.loads(text) != value:
        raise InputError(f"{name} does not survive a JSON round trip unchanged (non-string keys or tuples?)")
    return value
