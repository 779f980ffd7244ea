"""Write GGUF files with quantized weights: `kvlab quantize SRC OUT.gguf --type q8_0` (llama-quantize's job).

Two sources:

* a GGUF file: every metadata field is copied as it is (vocabulary, chat template, RoPE settings, ...)
  except `general.file_type`, and every matrix is requantized from its dequantized values, in the file's
  own row order (Q/K rows stay permuted: nothing to undo or redo). 1-D tensors (norms, biases, Llama 3's
  rope_freqs) stay float32.
* a Hugging Face folder: the metadata llama.cpp's converter writes for llama/mistral/qwen2 (hyper-
  parameters, RoPE, the tokenizer as `tokenizer.ggml.*`, special ids, chat template), and the matrices in
  ggml's layout (Llama/Mistral q_proj/k_proj rows permuted for ggml's RoPE, as the converter does). Only
  byte-level BPE tokenizers ("gpt2") whose pre-tokenizer has a llama.cpp name are written; anything else
  is refused with the reason (convert with llama.cpp's convert_hf_to_gguf.py, then quantize that file).

The block encoders are llama.cpp's reference ones from the `gguf` package (bit-exact with ggml-quants.c
for Q8_0, and its own definitions for Q4_0/Q4_1/Q5_0/Q5_1). The file is written next to OUT and renamed
into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvlab.errors import CheckpointError, InputError
from kvlab.gguf.tensors import GLOBAL_NAMES, LAYER_NAMES, PERMUTED_ARCHITECTURES, SUPPORTED_TYPES

# ggml's llama_ftype numbers for general.file_type (llama.h): the type most tensors have
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
GGUF_LAYER_PARTS = {hf: gguf for gguf, hf in LAYER_NAMES.items()}
GGUF_GLOBALS = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}


def gguf_tensor_name(hf: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` (and the three global tensors)."""
    if hf in GGUF_GLOBALS:
        return GGUF_GLOBALS[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER_PARTS[part]}.{kind}"


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's rotate-halves row order of a q_proj/k_proj weight -> ggml's interleaved pairs (the converter's)."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def _encode(weight: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """(bytes or float32 array, ggml type) of a tensor: 1-D tensors stay float32, matrices get `type_name`."""
    import gguf

    if weight.ndim == 1 or type_name == "F32":
        return np.ascontiguousarray(weight, dtype=np.float32), gguf.GGMLQuantizationType.F32
    kind = gguf.GGMLQuantizationType[type_name]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if weight.shape[-1] % block:
        raise InputError(f"a {weight.shape} matrix cannot be {type_name}: rows must hold whole blocks of "
                         f"{block} weights")
    return gguf.quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), kind), kind


def _atomic_gguf(out: Path, fill: Callable[[Any], None], arch: str) -> None:
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def quantize_gguf(source: Path, out: Path, type_name: str) -> int:
    """Requantize every matrix of a GGUF file; returns the number of tensors written."""
    import gguf

    from kvlab.gguf.tensors import dequantize as dequantize_tensor
    from kvlab.gguf.reader import read_gguf

    kvlab_view = read_gguf(source)  # kvlab's checked reader: a damaged file is refused here, with its name
    reader = gguf.GGUFReader(str(source))
    arch = kvlab_view.get("general.architecture")
    for name, info in kvlab_view.tensors.items():
        if info.type_name not in SUPPORTED_TYPES:
            raise CheckpointError(f"{source}: tensor {name!r} is {info.type_name}; kvlab reads "
                                  + ", ".join(SUPPORTED_TYPES))

    def fill(writer: Any) -> None:
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
                continue
            value_type = field.types[0]
            if value_type == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(field.name, field.contents(), value_type, sub_type=field.types[-1])
            else:
                writer.add_key_value(field.name, field.contents(), value_type)
        writer.add_file_type(FILE_TYPES[type_name])
        for name, info in kvlab_view.tensors.items():
            values = dequantize_tensor(kvlab_view, info, np.dtype(np.float32))
            data, kind = _encode(values, type_name)
            writer.add_tensor(name, data, raw_dtype=kind)

    _atomic_gguf(out, fill, arch)
    return len(kvlab_view.tensors)


def bpe_pre_name(tokenizer_json: dict) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizers byte-level BPE, or InputError saying why not."""
    from kvlab.gguf.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT

    model, pre = tokenizer_json.get("model") or {}, tokenizer_json.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or not isinstance(pre, dict):
        raise InputError("only byte-level BPE tokenizers can be written to GGUF here; convert this model with "
                         "llama.cpp's convert_hf_to_gguf.py and run kvlab quantize on that file")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt2"
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"]:
        pattern = (parts[0].get("pattern") or {}).get("Regex")
        named = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
        if pattern in named:
            return named[pattern]
    raise InputError(f"this tokenizer's pre-tokenizer ({pre.get('type')}: {kinds}) has no llama.cpp name kvlab "
                     "knows; convert with llama.cpp's convert_hf_to_gguf.py and run kvlab quantize on that file")


def write_model(out: Path, config: Any, weights: dict[str, np.ndarray], tokenizer_spec: dict, tokenizer: Any,
                type_name: str, name: str, progress: Callable[[str], None] | None = None) -> int:
    """A model read from an HF folder (config, float weights by HF name, its tokenizer.json as a dict and
    the loaded tokenizer) as a GGUF file of `type_name` matrices; returns the number of tensors."""
    arch = ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise InputError(f"architecture {config.architecture} cannot be written to GGUF here")
    if config.rope_scaling is not None:
        raise InputError("RoPE scaling is not written to GGUF here; convert with llama.cpp's "
                         "convert_hf_to_gguf.py and run kvlab quantize on that file")
    pre = bpe_pre_name(tokenizer_spec)
    vocab = tokenizer_spec["model"]["vocab"]
    tokens = [""] * max(config.vocab_size, len(vocab))
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"]: t["content"] for t in tokenizer_spec.get("added_tokens", [])}
    for index, content in special.items():
        tokens[index] = content
    tokens = tokens[:config.vocab_size] + [f"[PAD{i}]" for i in range(len(tokens), config.vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_spec["model"].get("merges", [])]
    types = [3 if i in special else 1 for i in range(len(tokens))]

    def fill(writer: Any) -> None:
        writer.add_name(name)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_vocab_size(config.vocab_size)
        if config.sliding_window is not None:
            writer.add_sliding_window(config.sliding_window)
        writer.add_file_type(FILE_TYPES[type_name])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        for setter, value in ((writer.add_bos_token_id, tokenizer.bos_token_id),
                              (writer.add_eos_token_id, tokenizer.eos_token_id),
                              (writer.add_pad_token_id, getattr(tokenizer, "pad_token_id", None))):
            if value is not None:
                setter(int(value))
        writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
        template = getattr(tokenizer.chat_template, "source", None) if tokenizer.chat_template else None
        if template:
            writer.add_chat_template(template)
        for i, (hf_name, weight) in enumerate(weights.items()):
            if progress:
                progress(f"tensor {i + 1}/{len(weights)}: {hf_name}")
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            if arch == "llama" and ".self_attn.q_proj." in hf_name:
                weight = permute_rows(weight, config.num_attention_heads)
            elif arch == "llama" and ".self_attn.k_proj." in hf_name:
                weight = permute_rows(weight, config.num_key_value_heads)
            data, kind = _encode(weight, type_name)
            writer.add_tensor(gguf_tensor_name(hf_name), data, raw_dtype=kind)

    _atomic_gguf(out, fill, arch)
    return len(weights)
