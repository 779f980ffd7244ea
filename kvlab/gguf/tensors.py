"""GGUF tensors as Hugging Face weights: names mapped, blocks dequantized, llama.cpp's Q/K row order undone.

Dequantization is llama.cpp's own definition: the `gguf` package's per-type block decoders (what
`gguf.quants.dequantize` runs), applied to 64k values at a time straight out of the memory map into the
output array, so the only full-size arrays are the weights themselves and the temporaries stay in cache
(~1.6x faster than `gguf.quants.dequantize`, which splits each tensor into 16-row groups: bench in the
report, same bits).

Why unpermute: llama.cpp's converter reorders the rows of every Llama q_proj and k_proj head from HF's
"rotate halves" RoPE layout to ggml's interleaved pairs (`reshape(heads, 2, d/2, in).swapaxes(1, 2)`).
kvlab computes RoPE the HF way, so each head's rows go back: `reshape(heads, d/2, 2, in).swapaxes(1, 2)`.
Qwen2 files are written without the permutation (ggml runs Qwen2 in NeoX mode), so they are used as is;
so are Qwen3, Phi-3 and Gemma's. SmolLM3 is converted as a Llama (permuted).

The families' own conventions (llama.cpp's converter, `convert_hf_to_gguf.py`): Qwen3 and Gemma 3 add
`attn_q_norm`/`attn_k_norm`; Gemma names its four norms `attn_norm`, `post_attention_norm`, `ffn_norm`
(before the MLP) and `post_ffw_norm`, and stores every norm weight with Gemma's +1 already added (here it
is taken off again: the weights come out in HF's form, `(1 + w)` stays the config's hook); Phi-3 keeps
its fused `attn_qkv` and a doubled-height `ffn_up` (gate rows, then up), read under HF's own fused names
(`qkv_proj`, `gate_up_proj`) and split for the model by `split_fused`; its LongRoPE factors are the
tensors `rope_factors_long`/`rope_factors_short`, read into the config (kvlab/gguf/config.py).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import ml_dtypes
import numpy as np

from kvlab.config import ModelConfig
from kvlab.errors import CheckpointError
from kvlab.gguf.reader import GGUFFile, TensorInfo
from kvlab.model.quantized import QuantizedMatrix, prepare_layout
from kvlab.model.weights import check_weights

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
# general.architecture -> its layer tensors (GGUF part -> HF module), as llama.cpp's converter names them
ARCH_LAYER_NAMES = {
    "llama": LAYER_NAMES, "mistral": LAYER_NAMES, "qwen2": LAYER_NAMES, "smollm3": LAYER_NAMES,
    "qwen3": {**LAYER_NAMES, **QK_NORM_NAMES},
    "gemma2": {**LAYER_NAMES, **GEMMA_NORM_NAMES},
    "gemma3": {**LAYER_NAMES, **GEMMA_NORM_NAMES, **QK_NORM_NAMES},
    "phi3": {**{k: v for k, v in LAYER_NAMES.items() if k not in ("ffn_gate", "ffn_up")},
             "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
CHUNK_VALUES = 1 << 16  # values decoded at once: the block decoders' temporaries stay cache-sized
PERMUTED_ARCHITECTURES = ("llama", "mistral", "smollm3")
NORM_SHIFTED_ARCHITECTURES = ("gemma2", "gemma3")  # norm weights stored as Gemma's (1 + w)
NORM_SHIFT = 1.0
# tensors read into the config rather than the weights: Llama 3's RoPE factors, Phi-3's LongRoPE factors
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF state-dict name of a GGUF tensor of a `arch` file, or None for tensors kvlab does not use."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    match = LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in parts:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{parts[part]}.{kind}"
    return None


def fused_parts(config: ModelConfig) -> list[tuple[str, list[tuple[str, int]]]]:
    """(fused HF name suffix, [(part suffix, rows)]) of the matrices Phi-3 stores fused: q, k, v rows in
    `qkv_proj`; gate, then up rows in `gate_up_proj` (llama.cpp's `attn_qkv` and double `ffn_up` alike).
    The GGUF side of kvlab/hf/fused.py: the two formats do not import each other."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return [("self_attn.qkv_proj.weight", [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                           ("self_attn.v_proj.weight", kv)]),
            ("mlp.gate_up_proj.weight", [("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)])]


def split_fused(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` with every fused matrix split into the model's names (views of its rows; whole rows of a
    QuantizedMatrix, whose blocks never cross rows); other tensors as they are."""
    out = dict(weights)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for fused, parts in fused_parts(config):
            if p + fused not in out:
                continue
            matrix, row = out.pop(p + fused), 0
            for part, rows in parts:
                piece = slice(row, row + rows)
                out[p + part] = matrix.row_view(row, row + rows) if isinstance(matrix, QuantizedMatrix) else matrix[piece]
                row += rows
    return out


def weight_plan(gguf: GGUFFile, config: ModelConfig) -> dict[str, TensorInfo]:
    """HF name -> tensor, after checking names, types and shapes against the config (nothing read yet)."""
    plan: dict[str, TensorInfo] = {}
    arch = gguf.get("general.architecture")
    for name, info in gguf.tensors.items():
        target = hf_name(name, arch)
        if target is None:
            if name in CONFIG_TENSORS:  # RoPE factors: read into the config's rope_scaling
                continue
            raise CheckpointError(f"{gguf.path}: unexpected tensor {name!r} for a {config.architecture} model")
        if info.type_name not in SUPPORTED_TYPES:
            raise CheckpointError(f"{gguf.path}: tensor {name!r} is {info.type_name}; supported tensor types: "
                                  + ", ".join(SUPPORTED_TYPES))
        plan[target] = info
    # ModelConfig's own check, on zero-cost stand-ins with the tensors' shapes: names and shapes are
    # validated exactly as for an HF folder, before a single block is dequantized.
    stand_ins = {name: np.broadcast_to(np.float32(0), info.shape) for name, info in plan.items()}
    for i in range(config.num_hidden_layers):  # a fused matrix must hold exactly its parts' rows
        for fused, parts in fused_parts(config):
            info = plan.get(f"model.layers.{i}.{fused}")
            want = (sum(rows for _, rows in parts), config.hidden_size)
            if info is not None and info.shape != want:
                raise CheckpointError(f"{gguf.path}: tensor {info.name!r} has shape {info.shape} but the "
                                      f"metadata implies {want}")
    check_weights(config, split_fused(config, stand_ins), source=f"{gguf.path} (tensor names in HF form)")
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
                 keep_stored: bool = False, activations: str = "float32") -> dict[str, np.ndarray | QuantizedMatrix]:
    """Every planned tensor dequantized into `dtype` (or, with `keep_stored`, matrices as the file stores
    them: see `as_stored`, in the layout `activations` reads, model/quantized.prepare_layout: a q8 load
    never holds the whole model in the float layout), with Llama's Q/K rows back in HF order and Gemma's
    norms without their +1."""
    dtype = np.dtype(dtype)
    permuted = gguf.get("general.architecture") in PERMUTED_ARCHITECTURES
    shifted = gguf.get("general.architecture") in NORM_SHIFTED_ARCHITECTURES
    weights: dict[str, np.ndarray | QuantizedMatrix] = {}
    for name, info in plan.items():
        array = as_stored(gguf, info, dtype) if keep_stored else dequantize(gguf, info, dtype)
        if shifted and name.endswith("norm.weight"):  # Gemma's stored (1 + w) back to w (exact in float64)
            array = (np.asarray(array, dtype=np.float64) - NORM_SHIFT).astype(dtype)
        heads = config.num_attention_heads if ".self_attn.q_proj." in name else \
            config.num_key_value_heads if ".self_attn.k_proj." in name else None
        if permuted and heads is not None:
            if isinstance(array, QuantizedMatrix):  # whole rows move: the blocks of a row stay together
                array = array.take_rows(unpermute_rows(np.arange(array.shape[0]), heads))
            else:
                array = unpermute_rows(array, heads)
        weights[name] = array
        gguf.release(info.name)  # read: its pages leave the resident set
        if keep_stored:
            stack_parts(weights, name, activations)
        if on_tensor is not None:
            on_tensor(info.nbytes)
    return weights


# the matrices a model stacks by rows (model/llama.py's _quantized_layers): q, k, v and gate, up
STACKED_PARTS = (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                 ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def stack_parts(weights: dict[str, Any], name: str, activations: str = "float32") -> None:
    """Once the last of a layer's q/k/v (or gate/up) is read, store them as row views of one stacked
    QuantizedMatrix (when their types agree), so the model's stacking finds the stack and copies nothing:
    building a model then holds one copy of the codes, not the parts beside their stack (a 1B Q4_0 file
    peaked at 1.5 GiB for 0.75 GiB of codes). Every matrix that waits for no other ends in the layout
    `activations` reads (the stack before its views are cut)."""
    match = re.fullmatch(r"(model\.layers\.\d+\.)(.+)", name)
    prefix, part = match.groups() if match else ("", name)
    group = next((g for g in STACKED_PARTS if part in g), None)
    if group is None:
        prepare_layout(weights[name], activations)
        return
    if not all(prefix + p in weights for p in group):
        return  # the rest of the stack is still to come
    parts = [weights[prefix + p] for p in group]
    if not QuantizedMatrix.can_concat(parts):
        for matrix in parts:
            prepare_layout(matrix, activations)
        return
    stack, row = QuantizedMatrix.concat(parts), 0
    del parts[:]  # the float parts go as the stack is cut into views
    prepare_layout(stack, activations)
    for p in group:
        rows = weights[prefix + p].shape[0]
        weights[prefix + p] = stack.row_view(row, row + rows)
        row += rows
