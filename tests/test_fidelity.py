"""kvlab fidelity: the exact cache measures as exact, lossy ones as measurably lossy, the CLI as a user runs it."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from kvlab import InputError, TinyLlama
from kvlab.fidelity import measure_fidelity
from kvlab.perplexity import perplexity


@pytest.fixture  # per test, not per module: mutation testing (scripts/mutation.py) sees each test's calls
def rows():
    model = TinyLlama(seed=9, max_position_embeddings=32)
    stream = np.random.default_rng(0).integers(0, 256, 70)
    found = measure_fidelity(model, stream, 256, ["exact", "window:32", "int8", "int4", "sinks:2:10",
                                                  "int8+window:12", "float32", "int8-channel"])
    return model, stream, {r.name: r for r in found}


def test_exact_and_a_window_as_long_as_each_text_window_report_no_change(rows):
    _, _, by_name = rows
    for name in ["exact", "window:32"]:
        r = by_name[name]
        assert (r.kl_mean, r.kl_max, r.top1_agreement, r.perplexity_change) == (0.0, 0.0, 1.0, 0.0), name
        assert r.evicted_tokens == 0 and r.tokens == 70
    assert by_name["exact"].bytes_per_token == 2 * 2 * 2 * 8 * 8  # K+V, 2 layers, 2 KV heads, d 8, float64


def test_lossy_choices_are_measurably_lossy_and_ordered(rows):
    _, _, by_name = rows
    int8, int4, sinks = by_name["int8"], by_name["int4"], by_name["sinks:2:10"]
    assert 0 < int8.kl_mean < int4.kl_mean and int8.kl_max >= int8.kl_mean
    assert int8.bytes_per_token < by_name["float32"].bytes_per_token < by_name["exact"].bytes_per_token
    assert by_name["float32"].kl_mean > 0  # a float64 model with a float32 cache rounds
    assert sinks.peak_tokens == 12 and sinks.evicted_tokens > 0 and sinks.kl_mean > 0
    assert by_name["int8+window:12"].peak_tokens == 12
    assert by_name["int8+window:12"].peak_bytes == pytest.approx(12 * int8.bytes_per_token)
    # per-channel keys read the contiguous cache (a block pool cannot hold them): the whole 32-token window
    channel = by_name["int8-channel"]
    assert channel.kv_dtype == "int8-channel" and channel.policy == "full"
    assert 0 < channel.kl_mean and channel.evicted_tokens == 0 and channel.peak_tokens == 32
    assert channel.peak_bytes == channel.bytes_per_token * 32 < by_name["float32"].peak_bytes
    model = rows[0]
    held = model.new_cache(kv_dtype="int8-channel")
    model.forward(np.arange(32)[None], cache=held)
    report = held.memory_report()  # codes and the per-token and per-block scales of 32 tokens
    assert channel.peak_bytes == report.payload_bytes + report.scale_bytes and report.scale_bytes > 0
    for r in by_name.values():  # a speed is reported (its size is the machine's: never bounded in a test)
        assert r.decode_tokens_per_s > 0 and math.isfinite(r.decode_tokens_per_s) and r.tokens == 70


def test_exact_perplexity_is_what_kvlab_perplexity_reports(rows):
    model, stream, by_name = rows
    want = perplexity(model, stream, 256, context=32)
    assert by_name["exact"].perplexity == pytest.approx(want.perplexity, rel=1e-10)


def test_bad_choices_are_refused_before_anything_runs():
    model = TinyLlama(seed=9, max_position_embeddings=32)
    calls = []
    for name in ("forward", "forward_batch"):  # count every forward: a refused choice runs none
        inner = getattr(model, name)
        setattr(model, name, lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k))
    for bad, message in [("window:64", "context is 32"), ("int3", "unsupported KV cache dtype"),
                         ("sink:4:4", "unsupported KV cache dtype"),
                         ("int8-channel+sinks:2:6", r"^int8-channel\+sinks:2:6: per-channel keys \(int8-channel\) are "
                          r"kept only by the contiguous cache, and cache policies run in the engine's block pool; "
                          r"measure them apart$"),
                         ("sinks:8:8", "sinks:8:8: kv_policy sinks:8:8: 8 sink tokens need a larger window than 8"),
                         ("h2o:4:4", r"H2O \(heavy hitters\) was removed")]:
        with pytest.raises(InputError, match=message):
            measure_fidelity(model, [1, 2, 3], 256, ["int8", bad])
    assert not calls
    with pytest.raises(InputError, match="non-empty"):
        measure_fidelity(model, [], 256)


def test_windows_shorter_than_a_block_run_in_the_engine_too():
    """A context of 5 tokens: the engine's pool for each window is sized from its length, however short."""
    model = TinyLlama(seed=9, max_position_embeddings=32)
    stream = np.random.default_rng(1).integers(0, 256, 12)
    rows = {r.name: r for r in measure_fidelity(model, stream, 256, ["int8", "sinks:1:3"], context=5)}
    assert rows["exact"].kl_mean == 0 and rows["exact"].tokens == 12
    assert rows["int8"].kl_mean > 0 and rows["sinks:1:3"].peak_tokens == 4


def kvlab(*args):
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True, timeout=600)


def test_cli_json_table_and_plot_on_the_shipped_model(tmp_path):
    plot = tmp_path / "fidelity.png"
    out = kvlab("fidelity", "--max-tokens", "40", "--context", "20", "--policy", "exact,int8",
                "--policy", "sinks:2:6", "--json", "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["exact", "int8", "sinks:2:6"] and result["tokens"] == 40
    assert rows["exact"]["kl_mean"] == 0 and rows["exact"]["top1_agreement"] == 1
    assert rows["int8"]["bytes_per_token"] / rows["exact"]["bytes_per_token"] == pytest.approx(0.28125)
    assert rows["sinks:2:6"]["peak_tokens"] == 8
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = kvlab("fidelity", "--max-tokens", "16", "--policy", "exact,int4")
    assert table.returncode == 0 and "int4" in table.stdout and "KL mean" in table.stdout


def test_cli_bad_policy_is_a_clear_error():
    out = kvlab("fidelity", "--max-tokens", "8", "--policy", "window:0")
    assert out.returncode == 2 and "window size W must be >= 1" in out.stderr


def test_weight_quantization_fidelity_is_ordered_by_bits_and_float32_is_exact():
    from kvlab.model.weights import random_weights
    from kvlab.fidelity import weight_fidelity

    config = TinyLlama(seed=0).config.replace(intermediate_size=64)
    weights = random_weights(config, 4, np.float32)
    ids = np.random.default_rng(0).integers(1, config.vocab_size, size=90).tolist()
    rows = weight_fidelity(config, weights, ids, 0, ["q8_0", "Q5_0", "q4_0"], context=32)
    assert [r.name for r in rows] == ["float32", "Q8_0", "Q5_0", "Q4_0"]
    exact, q8, q5, q4 = rows
    assert exact.kl_mean == 0 and exact.top1_agreement == 1 and exact.perplexity_change == 0
    assert exact.file_bytes_per_weight == exact.resident_bytes_per_weight == 4
    assert 0 < q8.kl_mean < q5.kl_mean < q4.kl_mean and q4.top1_agreement < 1
    assert (q8.file_bytes_per_weight, q5.file_bytes_per_weight, q4.file_bytes_per_weight) == (1.0625, 0.6875,
                                                                                             0.5625)
    # Q4_0 kept as codes + float32 scales (0.625): its offsets (-8 * scale) are folded into the kernels, but
    # for the tail rows after the last tile of 8 (float32 offsets, 0.125 more)
    from kvlab.model.quantized import quantize_weights

    matrices = [w for w in quantize_weights(weights, "q4_0").values() if np.ndim(w) == 2]
    count = sum(w.shape[0] * w.shape[1] for w in matrices)
    tail = sum(w.shape[0] % 8 * w.shape[1] for w in matrices)
    assert q4.resident_bytes_per_weight == pytest.approx((0.625 * count + 0.125 * tail) / count, rel=1e-12)
    assert all(r.tokens == 90 for r in rows)
    with pytest.raises(InputError, match="unknown weight quantization 'q3_x'; choose from q8_0"):
        weight_fidelity(config, weights, ids, 0, ["q8_0", "q3_x"])


def test_cli_weight_fidelity_json_and_bad_type():
    run = [sys.executable, "-m", "kvlab.cli", "fidelity", "--weights", "q8_0,q4_1", "--max-tokens", "64",
           "--json"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["name"] for r in rows] == ["float32", "Q8_0", "Q4_1"] and rows[1]["kl_mean"] < rows[2]["kl_mean"]
    bad = subprocess.run(run[:5] + ["q8_0,q9"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown weight quantization 'q9'" in bad.stderr and not bad.stdout


def test_weight_fidelity_of_int8_activations_adds_their_rounding():
    """"q8_0+q8" runs the quantized model with its products' inputs rounded to int8 (llama.cpp's way): the
    same bytes as Q8_0, a larger distance from float32 than the weights alone, and a clear refusal for an
    activation type that does not exist."""
    from kvlab.fidelity import weight_fidelity
    from kvlab.model.weights import random_weights

    config = TinyLlama(seed=0).config.replace(intermediate_size=64)
    weights = random_weights(config, 4, np.float32)
    ids = np.random.default_rng(0).integers(1, config.vocab_size, size=90).tolist()
    rows = weight_fidelity(config, weights, ids, 0, ["q8_0", "q8_0+q8"], context=32)
    assert [r.name for r in rows] == ["float32", "Q8_0", "Q8_0+q8"]
    _, weights_only, rounded = rows
    assert 0 < weights_only.kl_mean < rounded.kl_mean
    assert rounded.file_bytes_per_weight == weights_only.file_bytes_per_weight == 1.0625
    # resident: codes + float32 scales (1.125); for q8 the integer kernels' layout of the tiles instead (one
    # copy of the codes): codes + float16 scales (1.0625) of every row in a tile of eight, the tail rows 1.125
    from kvlab.model.quantized import quantize_weights

    matrices = [w for w in quantize_weights(weights, "q8_0").values() if np.ndim(w) == 2]
    tiled = sum(w.tiles.scales.shape[0] * 8 * w.shape[1] for w in matrices)
    count = sum(w.shape[0] * w.shape[1] for w in matrices)
    assert 0.9 < tiled / count < 1
    assert weights_only.resident_bytes_per_weight == 1.125
    assert rounded.resident_bytes_per_weight == pytest.approx((1.0625 * tiled + 1.125 * (count - tiled)) / count,
                                                               rel=1e-12)
    with pytest.raises(InputError, match=r"unknown activations in 'q8_0\+q4'"):
        weight_fidelity(config, weights, ids, 0, ["q8_0+q4"])
