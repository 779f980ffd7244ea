"""The fused decode kernels on the families' layers (issue 34): the per-head q/k norms (Qwen3, Gemma 3) inside
`qkv_rope`, and each half of a block fused on its own (model/ops.py `bind`).

A Qwen3-shaped layer (hidden 128, head_dim 64: wide enough that a norm over the wrong span or a norm
skipped moves logits by O(1)) takes both fused calls per layer, float and block-quantized; a Gemma 3
layer fuses its attention half and takes its MLP half (norms after attention and MLP, GeGLU) step by
step. Each is held to the NumPy reference through prefill and cached decode steps within the bounds
tests/test_kernels.py holds a Llama to (1e-4 of the logit scale; 1e-10 in float64).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvlab import LlamaModel
from kvlab.config import ModelConfig
from kvlab.kernels import AVAILABLE
from kvlab.model.weights import random_weights

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

BASE = {"vocab_size": 97, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 64}
QWEN3 = ModelConfig(architecture="Qwen3ForCausalLM", qk_norm=True, **BASE)
GEMMA3 = ModelConfig(architecture="Gemma3ForCausalLM", qk_norm=True, hidden_act="gelu_pytorch_tanh",
                     norm_weight_offset=1.0, sandwich_norm=True, scale_embeddings=True, query_pre_attn_scalar=48,
                     **BASE)


def scale_of(logits: np.ndarray) -> float:
    return max(1.0, float(np.abs(logits.astype(np.float64)).max()))


def run_schedule(model: LlamaModel, ids: np.ndarray, prefill: int = 3) -> np.ndarray:
    """Logits of a prefill then one-token decode steps through the cache (the fused kernels' rows)."""
    cache = model.new_cache(ids.shape[0])
    out = [model.forward(ids[:, :prefill], cache=cache).logits]
    out += [model.forward(ids[:, i:i + 1], cache=cache).logits for i in range(prefill, ids.shape[1])]
    return np.concatenate(out, axis=1)


def fused_calls(model: LlamaModel, attribute: str, ids: np.ndarray) -> dict[str, int]:
    """The fused kernels' calls (ops.`attribute`: "_fused" or "_qfused") over one decode step of ids, taken
    as two calls a layer (`fuse_decode` off: the one-call block runs the same two kernels inside, and
    tests/test_decode_block.py holds it to them bit for bit)."""
    from fused_calls import CountingFused

    cache = model.new_cache(ids.shape[0])
    model.forward(ids[:, :-1], cache=cache)
    counting = CountingFused(getattr(model.ops, attribute))
    setattr(model.ops, attribute, counting)
    model.ops.fuse_decode = False
    try:
        model.forward(ids[:, -1:], cache=cache)
    finally:
        setattr(model.ops, attribute, counting.module)
        model.ops.fuse_decode = True
    return counting.calls


def pair(config: ModelConfig, weights: dict, dtype=np.float32, weights_dtype=None,
         activations=None) -> tuple[LlamaModel, LlamaModel]:
    """(compiled, reference) over the same weights."""
    return tuple(LlamaModel(config, weights, dtype=dtype, weights_dtype=weights_dtype, backend=backend,
                            activations=activations) for backend in ("numba", "numpy"))


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_qwen3_layers_fuse_both_halves_and_equal_the_reference(weights_dtype, batch):
    """Both fused calls on every Qwen3 layer (q/k norms in `qkv_rope`); logits of prefill + decode steps
    within 1e-4 of the logit scale of the NumPy reference, whatever the weights are stored in."""
    compiled, reference = pair(QWEN3, random_weights(QWEN3, 5, np.float64), weights_dtype=weights_dtype)
    ids = np.random.default_rng(batch).integers(0, 97, size=(batch, 10))
    layers = QWEN3.num_hidden_layers
    assert fused_calls(compiled, "_fused", ids) == {"qkv_rope": layers, "output_mlp": layers}
    got, want = run_schedule(compiled, ids), run_schedule(reference, ids)
    assert np.abs(got - want).max() <= 1e-4 * scale_of(want)


def test_qwen3_fused_equals_the_reference_in_float64():
    compiled, reference = pair(QWEN3, random_weights(QWEN3, 6, np.float64), dtype=np.float64)
    ids = np.random.default_rng(0).integers(0, 97, size=(2, 12))
    got = run_schedule(compiled, ids, 5)
    assert np.abs(got - run_schedule(reference, ids, 5)).max() <= 1e-10
    assert np.abs(got - reference.forward(ids).logits).max() <= 1e-10  # and a full recompute


def test_the_q_and_k_norms_are_applied_each_with_its_own_weight():
    """Swapping q_norm and k_norm (or dropping them) in the compiled model moves its logits far from the
    reference's: the kernel reads each norm, over each head, and the test above can fail."""
    weights = random_weights(QWEN3, 7, np.float64)
    swapped = dict(weights)
    for i in range(QWEN3.num_hidden_layers):
        q, k = f"model.layers.{i}.self_attn.q_norm.weight", f"model.layers.{i}.self_attn.k_norm.weight"
        swapped[q], swapped[k] = weights[k], weights[q]
    ids = np.random.default_rng(1).integers(0, 97, size=(1, 8))
    want = run_schedule(pair(QWEN3, weights)[1], ids)
    compiled = pair(QWEN3, swapped)[0]
    assert np.abs(run_schedule(compiled, ids) - want).max() > 1e-2 * scale_of(want)


def test_gemma3_fuses_its_attention_half_and_steps_through_its_mlp_half():
    """Gemma 3: (1 + w) q/k norms in the fused `qkv_rope`; its norms after attention and MLP and GeGLU
    keep `output_mlp` step by step. Logits as the reference's, to the same bound."""
    compiled, reference = pair(GEMMA3, random_weights(GEMMA3, 8, np.float64))
    ids = np.random.default_rng(2).integers(0, 97, size=(2, 10))
    assert fused_calls(compiled, "_fused", ids) == {"qkv_rope": GEMMA3.num_hidden_layers, "output_mlp": 0}
    got, want = run_schedule(compiled, ids), run_schedule(reference, ids)
    assert np.abs(got - want).max() <= 1e-4 * scale_of(want)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_quantized_qwen3_layers_fuse_both_halves_and_equal_the_reference(type_name):
    """Block-quantized Qwen3 matrices kept as stored: both fused calls of kernels/qdecode_layer.py on every
    layer, logits within 1e-4 of the logit scale of the NumPy reference over the same blocks."""
    from kvlab.model.quantized import quantize_weights

    weights = quantize_weights(random_weights(QWEN3, 9, np.float32), type_name)
    compiled, reference = pair(QWEN3, weights)
    assert compiled.quantized and reference.quantized
    ids = np.random.default_rng(3).integers(0, 97, size=(2, 10))
    layers = QWEN3.num_hidden_layers
    assert fused_calls(compiled, "_qfused", ids) == {"qkv_rope": layers, "output_mlp": layers}
    got, want = run_schedule(compiled, ids), run_schedule(reference, ids)
    assert np.abs(got - want).max() <= 1e-4 * scale_of(want)


def test_quantized_qwen3_with_int8_activations_stays_within_the_modes_rounding():
    """`activations="q8"` (integer products on every path): the compiled and the reference round each
    product's input at boundaries that may differ by a float32 ulp, so they agree to the rounding's own size
    (tests/test_int8_activations.py's rule: at most twice the reference's distance from exact products)."""
    from kvlab.model.quantized import quantize_weights

    weights = quantize_weights(random_weights(QWEN3, 10, np.float32), "Q8_0")
    compiled, reference = pair(QWEN3, weights, activations="q8")
    exact = pair(QWEN3, weights)[1]
    ids = np.random.default_rng(4).integers(0, 97, size=(1, 10))
    assert fused_calls(compiled, "_qfused", ids)["qkv_rope"] == QWEN3.num_hidden_layers
    want = run_schedule(reference, ids)
    rounding = np.abs(run_schedule(exact, ids) - want).max()
    assert rounding > 1e-3 * scale_of(want)
    assert np.abs(run_schedule(compiled, ids) - want).max() <= 2 * rounding
