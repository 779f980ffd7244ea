"""The layer loop's two seams (model/ops.py, model/attention.py) as the model uses them: each backend's Ops
and each Attention give the same logits as the NumPy reference, on the paths the other tests reach least."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab import TinyLlama
from kvlab.model.attention import ContiguousAttention, ObservedAttention


def test_an_observed_attention_refuses_one_that_reads_the_cache_in_place():
    model = TinyLlama(seed=1, backend="numba")
    in_place = ContiguousAttention(None, np.arange(3), 1, model.config, True, model.dtype)
    with pytest.raises(ValueError, match=r"^an observed attention must gather \(build it with compiled=False\)$"):
        ObservedAttention(in_place, lambda *args: None)
