"""GGUF tensors as Hugging Face weights: names mapped, blocks dequantized, llama.cpp's Q/K row order undone.

Dequantization is llama.cpp's own definition: the `gguf` package's per-type block decoders (what
`gguf.quants.dequantize` runs), applied to 64k values at a time straight out of the memory map into the
output array, so the only full-size arrays are the weights themselves and the temporaries stay in cache
(~1.6x faster than `gguf.quants.dequantize`, which splits each tensor into 16-row groups: bench in the
report, same bits).

Why unpermute: llama.cpp's converter reorders the rows of every Llama q_proj and k_proj head from HF's
"rotate halves" RoPE layout to ggml's interleaved pairs (`reshape(heads, 2, d/2, in).swapaxes(1, 2)`).
kvlab computes RoPE the HF way, so each head's rows go back: `reshape(heads, d/2, 2, in).swapaxes(1, 2)`.
Qwen2 files are written without the permutation (ggml runs Qwen2 in NeoX mode), so they are used as is.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import ml_dtypes
import numpy as np

from kvlab.config import ModelConfig
from kvlab.errors import CheckpointError
from kvlab.gguf.reader import GGUFFile, TensorInfo
from kvlab.model.quantized import QuantizedMatrix
from kvlab.model.weights import check_weights

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
CHUNK_VALUES = 1 << 16  # values decoded at once: the block decoders' temporaries stay cache-sized
PERMUTED_ARCHITECTURES = ("llama", "mistral")


def hf_name(name: str) -> str | None:
    """The HF state-dict name of a GGUF tensor, or None for tensors kvlab does not use."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    return None


def weight_plan(gguf: GGUFFile, config: ModelConfig) -> dict[str, TensorInfo]:
    """HF name -> tensor, after checking names, types and shapes against the config (nothing read yet)."""
    plan: dict[str, TensorInfo] = {}
    for name, info in gguf.tensors.items():
        target = hf_name(name)
        if target is None:
            if name == "rope_freqs.weight":  # Llama 3 RoPE factors: read into the config's rope_scaling
                continue
            raise CheckpointError(f"{gguf.path}: unexpected tensor {name!r} for a {config.architecture} model")
        if info.type_name not in SUPPORTED_TYPES:
            raise CheckpointError(f"{gguf.path}: tensor {name!r} is {info.type_name}; supported tensor types: "
                                  + ", ".join(SUPPORTED_TYPES))
        plan[target] = info
    # ModelConfig's own check, on zero-cost stand-ins with the tensors' shapes: names and shapes are
    # validated exactly as for an HF folder, before a single block is dequantized.
    stand_ins = {name: np.broadcast_to(np.float32(0), info.shape) for name, info in plan.items()}
    check_weights(config, stand_ins, source=f"{gguf.path} (tensor names in HF form)")
    return plan


def dequantize(gguf: GGUFFile, info: TensorInfo, dtype: np.dtype) -> np.ndarray:
    """The tensor as a float array of `dtype`, decoded a chunk of blocks at a time from the memory map."""
    import gguf as ggml

    out = np.empty(info.shape, dtype=dtype)
    raw = gguf.raw(info.name)
    if info.type_name in ("F32", "F16"):
        out[...] = raw.view("<f4" if info.type_name == "F32" else "<f2").reshape(info.shape)
        return out
    block, size = ggml.GGML_QUANT_SIZES[ggml.GGMLQuantizationType[info.type_name]]
    codec = getattr(ggml.quants, info.type_name)  # llama.cpp's block decoder for this type
    blocks, flat = raw.reshape(-1, size), out.reshape(-1)
    step = max(1, CHUNK_VALUES // block)
    for start in range(0, blocks.shape[0], step):
        part = np.asarray(blocks[start:start + step])
        flat[start * block:(start + part.shape[0]) * block] = codec.dequantize_blocks(part).reshape(-1)
    return out


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head RoPE row permutation of a q_proj/k_proj weight [heads*d, in] or bias."""
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def as_stored(gguf: GGUFFile, info: TensorInfo, dtype: np.dtype) -> np.ndarray | QuantizedMatrix:
    """A matrix as the file stores it: F16/BF16 kept half (the compiled kernels widen in registers), block
    types as a QuantizedMatrix (codes, scales, offsets: unpacked once, model/ggml_quants.py); F32 and 1-D
    tensors in `dtype`."""
    if len(info.shape) != 2 or info.type_name == "F32":
        return dequantize(gguf, info, dtype)
    raw = gguf.raw(info.name)
    if info.type_name in ("F16", "BF16"):
        half = np.dtype("<f2") if info.type_name == "F16" else np.dtype(ml_dtypes.bfloat16)
        return np.array(raw.view(half).reshape(info.shape))
    return QuantizedMatrix.from_blocks(info.type_name, raw, info.shape)


def read_weights(gguf: GGUFFile, config: ModelConfig, plan: dict[str, TensorInfo], dtype: Any,
                 on_tensor: Callable[[int], None] | None = None,
                 keep_stored: bool = False) -> dict[str, np.ndarray | QuantizedMatrix]:
    """Every planned tensor dequantized into `dtype` (or, with `keep_stored`, matrices as the file stores
    them: see `as_stored`), with Llama's Q/K rows back in HF order."""
    dtype = np.dtype(dtype)
    permuted = gguf.get("general.architecture") in PERMUTED_ARCHITECTURES
    weights: dict[str, np.ndarray | QuantizedMatrix] = {}
    for name, info in plan.items():
        array = as_stored(gguf, info, dtype) if keep_stored else dequantize(gguf, info, dtype)
        heads = config.num_attention_heads if ".self_attn.q_proj." in name else \
            config.num_key_value_heads if ".self_attn.k_proj." in name else None
        if permuted and heads is not None:
            if isinstance(array, QuantizedMatrix):  # whole rows move: the blocks of a row stay together
                array = array.take_rows(unpermute_rows(np.arange(array.shape[0]), heads))
            else:
                array = unpermute_rows(array, heads)
        weights[name] = array
        if on_tensor is not None:
            on_tensor(info.nbytes)
    return weights
