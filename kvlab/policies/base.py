"""What every cache policy answers: how many rows the cache may hold, and which to keep when it is full.

A policy never touches arrays itself. Before a step writes `num_new` rows of a sequence, the engine
(kvlab/engine/kv_bounds.py) asks `keep(length, num_new)` for the row indices to keep and gives back the
blocks of the rest; PolicyCache (kvlab/verify/policy_reference.py) does the same by hand on the reference
cache, moving the kept rows to positions 0..n-1.
"""

from __future__ import annotations

import numpy as np

from kvlab import validate
from kvlab.errors import InputError


class Policy:
    """Base class: `budget` rows at most once the new rows are written; `max_chunk` new rows per forward."""

    name = "policy"
    budget: int

    @property
    def max_chunk(self) -> int:
        """Most new rows one forward may write (the rows a policy protects must still fit beside them)."""
        return self.budget

    def keep(self, length: int, num_new: int) -> np.ndarray:
        """Ascending indices of the cached rows to keep so that kept + num_new <= budget.

        Only called when length + num_new > budget, with 1 <= num_new <= max_chunk.
        """
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


def positive_int(value: object, what: str, low: int = 1) -> int:
    """`value` as an int >= low, or InputError naming `what`."""
    if isinstance(value, str):  # the digits of a policy spec ("window:64")
        try:
            number = int(value)
        except ValueError:
            raise InputError(f"{what} must be an integer, got {value!r}") from None
    elif validate.is_int(value):  # the one int check: not a bool, not a float
        number = int(value)
    else:
        raise InputError(f"{what} must be an integer, got {value!r}")
    if number < low:
        raise InputError(f"{what} must be >= {low}, got {number}")
    return number


def recent(length: int, count: int) -> np.ndarray:
    """The last `count` row indices of a cache holding `length` rows."""
    return np.arange(max(length - count, 0), length)
