"""The layer loop's two seams (model/ops.py, model/attention.py) as the model uses them: each backend's Ops
and each Attention give the same logits as the NumPy reference, on the paths the other tests reach least."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvlab import Engine, SamplingParams, TinyLlama, generate
from kvlab.config import tiny_config
from kvlab.model.llama import LlamaModel
from kvlab.model.quantized import quantize_weights
from kvlab.model.weights import random_weights


def biased_models():
    """The tiny config with attention biases (q/k/v and, as Llama's attention_bias has it, o_proj), on the
    compiled and the NumPy backend, the same random float64 weights (biases drawn, not zero)."""
    config = tiny_config(attention_bias=True)
    weights = random_weights(config, seed=3)
    rng = np.random.default_rng(4)
    for i in range(config.num_hidden_layers):
        weights[f"model.layers.{i}.self_attn.o_proj.bias"] = rng.standard_normal(config.hidden_size)
    return [LlamaModel(config, weights, dtype=np.float64, backend=b) for b in ("numba", "numpy")], weights


def test_biased_layers_give_the_reference_logits_on_the_compiled_paths():
    (compiled, reference), weights = biased_models()
    prompt = np.arange(40, 60)[None]  # 20 rows: the BLAS path; then single rows: the fused block kernels
    caches = [m.new_cache() for m in (compiled, reference)]
    steps = [prompt, [[7]], [[8]], [[9]]]
    for ids in steps:
        got, want = (m.forward(ids, cache=c).logits for m, c in zip((compiled, reference), caches))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    # the full recompute of every position agrees with the cached steps (the biases enter K and V too)
    full = reference.forward(np.concatenate([prompt[0], [7, 8, 9]])[None]).logits[0, -1]
    np.testing.assert_allclose(want[0, -1], full, rtol=0, atol=1e-10)
    # and the o_proj bias is in the sum: without it the logits move
    for name in [n for n in weights if n.endswith("o_proj.bias")]:
        weights[name] = np.zeros_like(weights[name])
    unbiased = LlamaModel(reference.config, weights, dtype=np.float64, backend="numpy")
    assert np.abs(unbiased.forward(prompt).logits - reference.forward(prompt).logits).max() > 1e-3


def test_biased_layers_in_the_engine_give_the_reference_tokens():
    (compiled, reference), _ = biased_models()
    prompts = [list(range(3, 25)), [5, 6, 7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in Engine(m, block_size=4).generate(prompts, params)]
            for m in (compiled, reference)]
    want = [generate(reference, [p], 6)[0].tolist() for p in prompts]
    assert outs[0] == outs[1] == want


def test_a_quantized_model_with_attention_biases_computes_the_dequantized_models_logits(tmp_path):
    """QuantizedOps adds the q/k/v biases after its products over codes (a Qwen2 GGUF kept as stored)."""
    import kvlab
    from gguf_files import small_config, write_gguf

    path = tmp_path / "qwen2.gguf"
    write_gguf(path, small_config("qwen2", max_position_embeddings=64), types=("Q8_0",))
    reference, _ = kvlab.load(path, backend="numpy")  # dequantized to float32
    model, _ = kvlab.load(path, weights_dtype="stored", backend="numba", activations="float32")
    assert type(model.ops).__name__ == "QuantizedOps" and model.layers[0].b_qkv is not None
    assert np.abs(model.layers[0].b_qkv).max() > 0
    ids = np.array([[5, 17, 99, 3, 250, 41, 8]])
    want = reference.forward(ids).logits
    scale = float(np.abs(want).max()) + 1
    assert np.abs(model.forward(ids).logits - want).max() <= 1e-4 * scale  # as tests/test_quantized_weights.py


def quantized_biased_models():
    """The biased tiny config (o_proj bias too) quantized to Q8_0 at load: QuantizedOps and NumpyOps."""
    config = tiny_config(attention_bias=True)
    weights = random_weights(config, seed=3, dtype=np.float32)
    rng = np.random.default_rng(4)
    for i in range(config.num_hidden_layers):
        weights[f"model.layers.{i}.self_attn.o_proj.bias"] = rng.standard_normal(config.hidden_size).astype(np.float32)
    return [LlamaModel(config, quantize_weights(weights, "q8_0"), dtype=np.float32, backend=b)
            for b in ("numba", "numpy")], weights


def test_quantized_products_add_every_bias_on_both_backends():
    (compiled, reference), weights = quantized_biased_models()
    assert type(compiled.ops).__name__ == "QuantizedOps" and reference.quantized
    for ids in (np.arange(40, 60)[None], np.arange(40, 45)[None]):  # tiles + BLAS, then the kernel over codes
        want = reference.forward(ids).logits
        scale = float(np.abs(want).max()) + 1
        assert np.abs(compiled.forward(ids).logits - want).max() <= 1e-4 * scale  # measured 1.2e-6 (scale 5.5)
    for name in [n for n in weights if n.endswith("o_proj.bias")]:
        weights[name] = np.zeros_like(weights[name])
    unbiased = LlamaModel(compiled.config, quantize_weights(weights, "q8_0"), dtype=np.float32, backend="numba")
    assert np.abs(unbiased.forward(ids).logits - compiled.forward(ids).logits).max() > 0.1  # measured 4.1


def test_the_numpy_backend_computes_quantized_products_without_the_compiled_kernels(monkeypatch):
    """The reference is NumPy only (model/ops.py): a quantized weight's product there never loads a kernel,
    even for the few rows where the compiled backend would use one."""
    (_, reference), _ = quantized_biased_models()
    want = [reference.forward(ids).logits for ids in (np.arange(40, 45)[None], [[7]])]
    monkeypatch.setitem(sys.modules, "kvlab.kernels.qgemv", None)  # importing it now raises ImportError
    for ids, logits in zip((np.arange(40, 45)[None], [[7]]), want):
        np.testing.assert_array_equal(reference.forward(ids).logits, logits)


KERNEL_MODULES = ("kvlab.kernels.attention", "kvlab.kernels.prefill_attention", "kvlab.kernels.decode_layer",
                  "kvlab.kernels.gemv", "kvlab.kernels.qgemv")


@pytest.mark.parametrize("window", [None, 3])
def test_the_numpy_backend_runs_every_attention_without_the_compiled_kernels(monkeypatch, window):
    """Contiguous prefill and decode and the engine's paged steps on the NumPy backend load
    no kernel module: the reference is NumPy only, whatever the cache could offer in place."""
    model = TinyLlama(seed=4, backend="numpy", sliding_window=window)
    prompts = [list(range(30, 50)), [4, 5, 6]]
    want = [generate(model, [p], 4)[0].tolist() for p in prompts]
    for name in KERNEL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # importing any of them now raises ImportError
    cache = model.new_cache()
    model.forward([prompts[0]], cache=cache)
    model.forward([[7]], cache=cache)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in Engine(model, block_size=4).generate(prompts, params)] == want


@pytest.mark.parametrize("backend, kv_dtype, policy, decode_kernel, prefill_kernel", [
    ("numba", "float32", None, True, True),      # a float pool: both kernels read the blocks in place
    ("numba", "float32", "window:16", True, True),  # a policy's key starts narrow the kernels' ranges
    ("numba", "int8", None, True, False),        # codes: the decode kernel reads them; prefill takes NumPy
    ("numpy", "float32", None, False, False),    # the reference backend never calls a kernel,
    ("numpy", "int8", None, False, False),       # not even on codes it could read
])
def test_paged_attention_takes_the_kernels_its_pool_allows(monkeypatch, backend, kv_dtype, policy, decode_kernel,
                                                           prefill_kernel):
    """Which path the engine's PagedAttention runs, counted per layer call (the paths agree to rounding,
    so only a count tells them apart): prefill chunks and decodes, a float or an int8 pool, with or
    without a cache policy, compiled or NumPy. A decode step never runs the prefill kernel, and what a
    kernel ran is never computed again by the NumPy gather (model/paged_attention.py)."""
    pytest.importorskip("numba")
    from kvlab.kernels import attention as decode_kernels, prefill_attention
    from kvlab.model import attention as seams

    calls = {"decode": 0, "prefill": 0, "numpy": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    # the paged decode's kernel call: one PagedDecodeCall per window a step, called once per layer
    monkeypatch.setattr(decode_kernels.PagedDecodeCall, "__call__",
                        counted("decode", decode_kernels.PagedDecodeCall.__call__))
    monkeypatch.setattr(prefill_attention, "varlen_prefill_attention",
                        counted("prefill", prefill_attention.varlen_prefill_attention))
    monkeypatch.setattr(seams, "paged_attention", counted("numpy", seams.paged_attention))
    config = tiny_config(head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    model = LlamaModel(config, random_weights(config, 3, np.float32), dtype=np.float32, backend=backend)
    # the attention seam's own paths: a float pool's decode step would otherwise run each block in one call
    # (kernels/decode_block.py, the same kernel inside; tests/test_decode_block.py counts and compares it)
    model.ops.fuse_decode = False
    engine = Engine(model, block_size=4, kv_cache_dtype=kv_dtype, kv_policy=policy)
    layers = config.num_hidden_layers
    engine.add_request("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()   # the prefill
    assert calls == {"decode": 0, "prefill": layers if prefill_kernel else 0, "numpy": 0 if prefill_kernel else layers}
    calls.update(decode=0, prefill=0, numpy=0)
    engine.step()   # one decode
    assert calls == {"decode": layers if decode_kernel else 0, "prefill": 0, "numpy": 0 if decode_kernel else layers}


@pytest.mark.parametrize("window", [None, 40])
def test_the_contiguous_decode_picks_its_kernel_by_the_key_rows_it_reads(monkeypatch, window):
    """The serial or the split-K kernel is chosen from the key rows a decode reads in all (sequences x KV
    heads x visible keys): 2 sequences x 2 KV heads x 100 keys, or 40 of them under a sliding window. The
    prefill before it took the prefill kernel, once per layer."""
    pytest.importorskip("numba")
    from kvlab.kernels import attention as decode_kernels, prefill_attention

    asked: list[int] = []
    real, real_prefill = decode_kernels.decode_kernel, prefill_attention.prefill_attention
    monkeypatch.setattr(decode_kernels, "decode_kernel", lambda rows: asked.append(rows) or real(rows))
    prefills: list[int] = []
    monkeypatch.setattr(prefill_attention, "prefill_attention",
                        lambda *args: prefills.append(1) or real_prefill(*args))
    config = tiny_config(sliding_window=window, max_position_embeddings=256)
    model = LlamaModel(config, random_weights(config, 3, np.float32), dtype=np.float32, backend="numba")
    cache = model.new_cache(2)
    model.forward(np.ones((2, 99), dtype=np.int64), cache=cache)
    assert len(prefills) == config.num_hidden_layers
    asked.clear()
    model.forward(np.ones((2, 1), dtype=np.int64), cache=cache)
    assert asked == [2 * config.num_key_value_heads * (window or 100)]


def test_float_kernels_fuse_up_to_max_fused_rows_and_not_beyond():
    """CompiledOps over float weights: up to `max_fused_rows` rows each layer is two fused calls (qkv+RoPE,
    output+MLP); one row more takes the products one by one (BLAS above the gemv kernels' limit)."""
    pytest.importorskip("numba")

    from fused_calls import CountingFused as Counting

    config = tiny_config(max_position_embeddings=64)
    model = LlamaModel(config, random_weights(config, 1, np.float32), dtype=np.float32, backend="numba")
    counting = model.ops._fused = Counting(model.ops._fused)
    layers = config.num_hidden_layers
    for rows, fused in ((1, layers), (model.ops.max_fused_rows, layers), (model.ops.max_fused_rows + 1, 0)):
        counting.calls = {"qkv_rope": 0, "output_mlp": 0}
        logits = model.forward(np.arange(rows)[None] % 50).logits
        assert counting.calls == {"qkv_rope": fused, "output_mlp": fused}, rows
        assert logits.dtype == np.float32   # the fused calls write the model's dtype
