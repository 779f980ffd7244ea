"""Longest common prefix of two token sequences: how many cached rows are still valid.

A cached K/V row for token i was computed from tokens 0..i, so it is valid for a new sequence exactly when
every one of those tokens is unchanged. The first differing position ends reuse, even if later token ids
happen to match again (the seed's "edited early" row). Sessions (kvlab/sessions) and the draft model's
cache (kvlab/engine/draft.py) both ask it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def common_prefix_length(cached: Sequence[int], tokens: Sequence[int]) -> int:
    """Number of leading positions where `cached` and `tokens` agree (a plain int)."""
    n = min(len(cached), len(tokens))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(cached[:n], dtype=np.int64) != np.asarray(tokens[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n
