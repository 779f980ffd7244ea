"""Weights by their Hugging Face names: expected shapes, seeded random init, and the model fingerprint.

The HF state-dict names (`model.layers.0.self_attn.q_proj.weight`, shape [out, in]) are the single naming
scheme in kvlab: random init produces them, checkpoints contain them, and the model fuses them on load.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping

import ml_dtypes
import numpy as np

from kvlab import validate
from kvlab.config import ModelConfig
from kvlab.errors import CheckpointError
from kvlab.model.quantized import QuantizedMatrix

# Tensors some checkpoints carry that the forward pass does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(config: ModelConfig, with_biases: Mapping[str, bool] | None = None) -> dict[str, tuple]:
    """Required tensor names -> shapes for this config (HF layout: Linear weights are [out, in])."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
        if config.qk_norm:  # Qwen3, Gemma 3: one RMSNorm weight per head dim, shared by the heads
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if config.sandwich_norm:  # Gemma: post_attention_layernorm normalises the attention output
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
    return shapes


def optional_shapes(config: ModelConfig) -> dict[str, tuple]:
    """Tensors that may be present: Llama's attention_bias also biases o_proj; tied files may keep lm_head."""
    shapes: dict[str, tuple] = {}
    if config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    if config.attention_bias:
        for i in range(config.num_hidden_layers):
            shapes[f"model.layers.{i}.self_attn.o_proj.bias"] = (config.hidden_size,)
    return shapes


def check_weights(config: ModelConfig, weights: Mapping[str, np.ndarray], source: str = "weights") -> None:
    """Raise CheckpointError naming the first missing, misshapen or unexpected tensor."""
    required, optional = expected_shapes(config), optional_shapes(config)
    missing = [name for name in required if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}{more}")
    for name, array in weights.items():
        want = required.get(name, optional.get(name))
        if want is None:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            raise CheckpointError(f"{source}: unexpected tensor {name!r} for this config")
        if tuple(array.shape) != want:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(array.shape)} but the config "
                                  f"implies {want}")
        if isinstance(array, QuantizedMatrix):  # GGUF blocks kept as stored: the scales must be finite
            bad = first_non_finite(array.scales) or (None if array.offsets is None
                                                     else first_non_finite(array.offsets))
            if bad is not None:
                raise CheckpointError(f"{source}: tensor {name!r} ({array.type_name}) has a scale {bad[1]}: "
                                      "weights must be finite")
            continue
        if getattr(array, "dtype", None) is None or array.dtype.kind not in "fV":  # V: bfloat16
            raise CheckpointError(f"{source}: tensor {name!r} must be a float array, got "
                                  f"{getattr(array, 'dtype', type(array).__name__)}")
        bad = first_non_finite(array)
        if bad is not None:
            raise CheckpointError(f"{source}: tensor {name!r} holds {bad[1]} at index {bad[0]}: weights must "
                                  "be finite (NaN or inf would turn every logit into NaN)")


def first_non_finite(array: np.ndarray) -> tuple[tuple[int, ...], float] | None:
    """(index, value) of the first NaN or inf in `array`, or None when every value is finite.

    Cost: one pass summing in the array's own dtype (about half a copy, measured on 200 MB of float32): any
    NaN or inf makes the sum non-finite, so a finite sum proves the tensor clean. Only a non-finite sum
    (a bad value, or an overflow of the sum itself) pays for the exact element-wise check.
    """
    array = np.asarray(array)
    if array.dtype.kind in "iub":
        return None
    with np.errstate(all="ignore"):
        if np.isfinite(array.sum()):
            return None
        bad = np.argwhere(~np.isfinite(array))
    if not bad.size:
        return None
    index = tuple(int(i) for i in bad[0])
    return index, float(array[index])


def random_weights(config: ModelConfig, seed: int = 0, dtype: object = np.float64) -> dict[str, np.ndarray]:
    """Fixed random weights from `seed`: N(0, 1/fan_in) matrices, N(1, 0.1) norms, N(0, 1) embeddings.

    Scaled so attention is far from uniform, which lets the verifier catch wrong masks and positions.
    """
    rng = np.random.default_rng(validate.seed(seed, allow_random=False))
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            array = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            array = rng.standard_normal(shape)
        elif name.endswith(".bias"):
            array = 0.1 * rng.standard_normal(shape)
        else:
            array = rng.standard_normal(shape) / np.sqrt(shape[-1])
        weights[name] = array.astype(dtype)
    return weights


HALF_DTYPES = ("float16", "bfloat16")


def resolve_weights_dtype(request: object, compute_dtype: np.dtype, weights: Mapping[str, np.ndarray],
                          source: str = "weights") -> np.dtype:
    """The dtype weight matrices are stored in: the compute dtype (request None or the compute dtype's
    name), the checkpoint's own half precision ("auto": when every matrix is float16, or every one is
    bfloat16; else the compute dtype), or a named half precision ("float16", "bfloat16"; rounds).

    Why keep half precision: a decode step streams every weight once, so bfloat16 halves the bytes, and
    the kernels widen in registers, so the math (and the logits) stay those of float32 over the same values.
    """
    compute_dtype = np.dtype(compute_dtype)
    name = None if request is None else str(getattr(request, "__name__", request)).lower()
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}.get(name, name)
    if name is None or name == compute_dtype.name:
        return compute_dtype
    if name == "auto":
        stored = {np.dtype(a.dtype).name for a in weights.values() if np.ndim(a) == 2}
        if len(stored) != 1 or next(iter(stored)) not in HALF_DTYPES or compute_dtype != np.float32:
            return compute_dtype
        name = stored.pop()
    if name not in HALF_DTYPES:
        raise CheckpointError(f"{source}: weights_dtype must be 'auto', {compute_dtype.name!r}, 'float16' or "
                              f"'bfloat16', got {request!r}")
    if compute_dtype != np.float32:
        raise CheckpointError(f"{source}: {name} weights need float32 compute, not {compute_dtype.name}")
    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float16)
    if dtype == np.float16:  # the kernels widen float16 bits exactly for finite values only
        for tensor, array in weights.items():
            if np.ndim(array) == 2 and not np.isfinite(np.asarray(array).astype(dtype)).all():
                raise CheckpointError(f"{source}: tensor {tensor!r} has inf or nan values")
    return dtype


def fingerprint(config: ModelConfig, dtype: np.dtype, weights: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the canonical config JSON, the compute dtype, and every tensor's name, shape and bytes.

    Deterministic across processes (no Python hash()), so saved caches can be checked against a model.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    digest.update(np.dtype(dtype).name.encode())
    for name in sorted(weights):
        if isinstance(weights[name], QuantizedMatrix):
            digest.update(f"{name}|{weights[name].type_name}|{weights[name].shape}".encode())
            weights[name].fingerprint_into(digest)
            continue
        array = np.ascontiguousarray(weights[name])
        digest.update(f"{name}|{array.dtype.name}|{array.shape}".encode())
        digest.update(array.reshape(-1).view(np.uint8))  # bytes of any dtype (bfloat16 has no buffer format)
    return digest.hexdigest()
