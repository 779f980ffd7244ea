"""Write GGUF files with quantized weights: `kvlab quantize SRC OUT.gguf --type q8_0` (llama-quantize's job).

Two sources:

* a GGUF file: every metadata field is copied as it is (vocabulary, chat template, RoPE settings, ...)
  except `general.file_type`, and every matrix is requantized from its dequantized values, in the file's
  own row order (Q/K rows stay permuted: nothing to undo or redo). 1-D tensors (norms, biases, Llama 3's
  rope_freqs) stay float32.
* a Hugging Face folder: the metadata llama.cpp's converter writes for llama/mistral/qwen2 and for the
  families qwen3, smollm3, phi3, gemma2 and gemma3 (hyperparameters, RoPE, the tokenizer as
  `tokenizer.ggml.*`, special ids, chat template), and the tensors in ggml's layout and names
  (Llama/Mistral/SmolLM3 q_proj/k_proj rows permuted for ggml's RoPE; Gemma's norms stored as (1 + w);
  Phi-3's fused `attn_qkv` and gate+up `ffn_up` and its LongRoPE factor tensors), as the converter does.
  A config that a llama.cpp file cannot carry (llama.cpp derives Gemma's attention scale from the shapes
  and hard-codes SmolLM3's NoPE layers and Gemma 2's tied output) is refused naming the field, rather
  than written as a file llama.cpp would run differently. Only byte-level BPE tokenizers ("gpt2") whose
  pre-tokenizer has a llama.cpp name are written; anything else is refused with the reason (convert with
  llama.cpp's convert_hf_to_gguf.py, then quantize that file).

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
from kvlab.gguf.config import GEMMA2_WINDOW, LARGEST_GEMMA_LAYERS, NO_ROPE_STEP, SWA_PATTERN
from kvlab.gguf.tensors import (ARCH_LAYER_NAMES, GLOBAL_NAMES, NORM_SHIFT, NORM_SHIFTED_ARCHITECTURES,
                                PERMUTED_ARCHITECTURES, SUPPORTED_TYPES, fused_parts)

# ggml's llama_ftype numbers for general.file_type (llama.h): the type most tensors have
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3",
                 "Gemma3ForCausalLM": "gemma3", "Gemma2ForCausalLM": "gemma2"}
GGUF_GLOBALS = {hf: gguf for gguf, hf in GLOBAL_NAMES.items()}


def gguf_tensor_name(hf: str, arch: str = "llama") -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` (and the three global tensors), as
    the converter names the tensors of `arch` (Gemma's `post_attention_layernorm` is `post_attention_norm`)."""
    if hf in GGUF_GLOBALS:
        return GGUF_GLOBALS[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    parts = {hf_part: gguf for gguf, hf_part in ARCH_LAYER_NAMES[arch].items()}
    return f"blk.{layer}.{parts[part]}.{kind}"


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
    check_representable(config, arch)
    weights = tensors_to_write(config, arch, weights)
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
        add_hyperparameters(writer, config, arch)
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
            if arch in PERMUTED_ARCHITECTURES and ".self_attn.q_proj." in hf_name:
                weight = permute_rows(weight, config.num_attention_heads)
            elif arch in PERMUTED_ARCHITECTURES and ".self_attn.k_proj." in hf_name:
                weight = permute_rows(weight, config.num_key_value_heads)
            elif arch in NORM_SHIFTED_ARCHITECTURES and hf_name.endswith("norm.weight"):
                weight = np.asarray(weight, dtype=np.float32) + np.float32(NORM_SHIFT)  # as transformers adds
            data, kind = _encode(weight, type_name)
            writer.add_tensor(gguf_tensor_name(hf_name, arch), data, raw_dtype=kind)
        for tensor_name, factors in rope_factor_tensors(config).items():
            writer.add_tensor(tensor_name, np.asarray(factors, dtype=np.float32))

    _atomic_gguf(out, fill, arch)
    return len(weights)


def gemma_attention_scalar(config: Any, arch: str) -> float:
    """The query_pre_attn_scalar llama.cpp uses for a Gemma of this shape (no key carries it): hidden / heads
    for the 27B models (known by their layer count), else head_dim."""
    large = config.num_hidden_layers == LARGEST_GEMMA_LAYERS[arch]
    return float(config.hidden_size // config.num_attention_heads if large else config.head_dim)


def _default_sliding(arch: str, layers: int) -> list[bool]:
    n = SWA_PATTERN[arch]
    return [i % n < n - 1 for i in range(layers)]


def check_representable(config: Any, arch: str) -> None:
    """InputError naming the first field a llama.cpp file of `arch` cannot carry as it is."""
    scaling = config.rope_scaling
    kind = None if scaling is None else scaling.get("rope_type")
    if kind not in (None, "linear") and not (kind == "longrope" and arch == "phi3"):
        raise InputError(f"RoPE scaling {kind!r} is not written to GGUF here; convert with llama.cpp's "
                         "convert_hf_to_gguf.py and run kvlab quantize on that file")
    if arch == "smollm3":
        rule = tuple(int((i + 1) % NO_ROPE_STEP != 0) for i in range(config.num_hidden_layers))
        if tuple(config.no_rope_layers or rule) != rule:
            raise InputError(f"no_rope_layers {list(config.no_rope_layers)} cannot be stored in a smollm3 GGUF: "
                             f"llama.cpp hard-codes every {NO_ROPE_STEP}th layer as NoPE")
    if arch == "phi3" and config.head_dim * config.num_attention_heads != config.hidden_size:
        raise InputError(f"head_dim {config.head_dim} cannot be stored in a phi3 GGUF: llama.cpp takes "
                         "hidden_size / num_attention_heads")
    if arch not in SWA_PATTERN:
        return
    derived = gemma_attention_scalar(config, arch)
    if config.query_pre_attn_scalar != derived:
        raise InputError(f"query_pre_attn_scalar {config.query_pre_attn_scalar:g} cannot be stored in a {arch} "
                         f"GGUF: llama.cpp derives {derived:g} from the shapes (head_dim, or hidden / heads "
                         "for the 27B models)")
    if arch == "gemma2":
        if config.attn_logit_softcapping is None or config.final_logit_softcapping is None:
            raise InputError("a gemma2 GGUF always soft-caps (llama.cpp's defaults 50 and 30): "
                             "attn_logit_softcapping and final_logit_softcapping must be set")
        if not config.tie_word_embeddings:
            raise InputError("an untied Gemma 2 cannot be stored in a gemma2 GGUF: llama.cpp's gemma2 takes "
                             "the output matrix from the embeddings (tie_word_embeddings)")
    elif config.attn_logit_softcapping is not None:
        raise InputError("attn_logit_softcapping cannot be stored in a gemma3 GGUF (llama.cpp has none)")


def add_hyperparameters(writer: Any, config: Any, arch: str) -> None:
    """The `{arch}.*` keys the converter writes for `arch` (conversion/{llama,qwen,phi,gemma}.py)."""
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    derived = config.head_dim * config.num_attention_heads == config.hidden_size
    if arch != "phi3" and not (arch == "smollm3" and derived):  # what llama.cpp derives, the converter omits
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "gemma2" or config.rope_theta != 10000.0:  # the gemma2 converter leaves llama.cpp's default
        writer.add_rope_freq_base(config.rope_theta)
    if arch in ("llama", "qwen2", "smollm3"):
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_vocab_size(config.vocab_size)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3":
        writer.add_rope_dimension_count(config.rotary_dim)
        if config.sliding_window is None:
            writer.add_sliding_window(0)  # the converter's "no window" (Phi-4)
        if scaling is not None and scaling["rope_type"] == "longrope":
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            writer.add_rope_scaling_attn_factors(scaling["attention_factor"])
    if arch in SWA_PATTERN:
        add_gemma_keys(writer, config, arch)


def add_gemma_keys(writer: Any, config: Any, arch: str) -> None:
    """Soft-caps, the window, the sliding layers (a bool per layer only where llama.cpp's default pattern
    would differ) and Gemma 3's local RoPE base."""
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    layers = config.num_hidden_layers
    sliding = [t == "sliding_attention" for t in config.layer_types or ("full_attention",) * layers]
    if any(sliding):
        writer.add_sliding_window(config.interleaved_sliding_window)
    elif arch == "gemma2":
        writer.add_sliding_window(GEMMA2_WINDOW)
    if (any(sliding) or arch == "gemma2") and sliding != _default_sliding(arch, layers):
        writer.add_sliding_window_pattern(sliding)
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(config.rope_local_base_freq)


def tensors_to_write(config: Any, arch: str, weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` under the names the file stores: Phi-3's parts joined into its fused matrices (a folder
    holds them fused already; a model's split weights are stacked back: q, k, v and gate, up rows)."""
    if arch != "phi3":
        return weights
    out = dict(weights)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for fused, parts in fused_parts(config):
            if all(p + part in out for part, _ in parts):
                out[p + fused] = np.concatenate([np.asarray(out.pop(p + part)) for part, _ in parts])
    return out


def rope_factor_tensors(config: Any) -> dict[str, list[float]]:
    """Phi-3's LongRoPE factors as the converter stores them (`rope_factors_long`, `rope_factors_short`)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type") != "longrope":
        return {}
    return {"rope_factors_long.weight": scaling["long_factor"], "rope_factors_short.weight": scaling["short_factor"]}
