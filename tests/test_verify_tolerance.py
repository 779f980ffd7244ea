"""The verifier's tolerance fits the dtype, the depth and the logits' size, and still catches a real mismatch.

A planted fault is a real cache bug in miniature: one cached value row of one head in one layer is off by a
small relative amount after it is written. The full recompute never sees it; every cached schedule does.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab.cache.kv_cache import KVCache
from kvlab.cli import main
from kvlab.model.weights import random_weights
from kvlab.verify import default_tolerance, verify_model


class PlantedFault(KVCache):
    """A cache that scales one stored value row (layer 0, head 0, position `row`) by `scale` once written."""

    row, scale = 5, 1.0

    def _write(self, layer, keys, values, positions):  # under both read paths: update and in-place append
        start = self.get_seq_length()
        end = super()._write(layer, keys, values, positions)
        if layer == 0 and start <= self.row < end:
            _, stored_values = self.store.read(0, end)
            stored_values[:, 0, self.row] *= self.scale
        return end


def faulty_model(scale: float, dtype=np.float32) -> kvlab.TinyLlama:
    class Faulty(kvlab.TinyLlama):
        def new_cache(self, batch_size=1, kv_dtype=None, capacity=16):
            cache = PlantedFault(self.cache_spec, batch_size, kv_dtype, capacity)
            cache.scale = scale
            return cache
    return Faulty(seed=7, dtype=dtype)


PAGED = ("paged", "engine", "speculative", "speculative-draft", "policy")  # over the block pool, not KVCache


@pytest.mark.parametrize("relative", [1e-3, 1e-4])
def test_a_one_row_corruption_fails_in_float32(relative):
    # the corruption is planted in KVCache; the paged schedules use the block pool and stay clean
    results = [r for r in verify_model(faulty_model(1 + relative)) if r.name not in PAGED]
    assert len(results) == 5
    assert not any(r.passed for r in results), [(r.name, r.max_abs_error, r.tolerance) for r in results]


def test_the_old_fixed_tolerance_missed_what_the_scaled_one_catches():
    """A 1e-4 relative error in one row changes logits by ~3e-5: under the old fixed 1e-4, over 1e-5."""
    model = faulty_model(1 + 1e-4)
    assert all(r.passed for r in verify_model(model, tolerance=1e-4))
    assert not any(r.passed for r in verify_model(model) if r.name not in PAGED)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clean_models_pass_with_margin(dtype):
    for seed in (0, 7):
        results = verify_model(kvlab.TinyLlama(seed=seed, dtype=dtype), length=48, seed=seed)
        worst = max(r.max_abs_error / r.tolerance for r in results)
        assert worst < 0.5, worst


def test_large_logits_do_not_cry_wolf_in_float32():
    """Logits of magnitude ~1e3 round to ~1e-4 in float32: a fixed 1e-4 fails a correct cache."""
    config = kvlab.tiny_config()
    weights = random_weights(config, 7, np.float64)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 300.0
    model = kvlab.LlamaModel(config, weights=weights, dtype=np.float32)
    scaled = verify_model(model)
    assert all(r.passed for r in scaled), [(r.max_abs_error, r.tolerance) for r in scaled]
    assert max(r.max_abs_logit for r in scaled) > 500
    assert not all(r.passed for r in verify_model(model, tolerance=1e-4))


def test_tolerance_rule_scales_with_dtype_and_depth():
    t32 = default_tolerance(kvlab.TinyLlama(seed=0, dtype=np.float32))
    t64 = default_tolerance(kvlab.TinyLlama(seed=0, dtype=np.float64))
    deep = default_tolerance(kvlab.TinyLlama(seed=0, dtype=np.float32, num_hidden_layers=6))
    assert t32.rtol == pytest.approx(8 * 2 * np.finfo(np.float32).eps)
    assert t32.rtol / t64.rtol == pytest.approx(np.finfo(np.float32).eps / np.finfo(np.float64).eps)
    assert deep.rtol == pytest.approx(3 * t32.rtol)
    assert t32.at(10.0) == pytest.approx(t32.rtol * 10 + t32.atol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bidirectional_negative_control_still_fails(dtype, capsys):
    assert main(["verify", "--bidirectional", "--dtype", dtype]) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at 80 columns
    assert "FAIL" in out and "not causal" in out and "tolerance = (max|logit| + 1) x 8 x 2 layers" in out


def test_verdict_prints_the_tolerance_and_its_derivation(capsys):
    assert main(["verify", "--dtype", "float32"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "PASS" in out and "eps 1.19e-07 (float32)" in out and "max|logit| per check" in out
