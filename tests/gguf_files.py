"""Small GGUF files for the tests, written with llama.cpp's own `gguf` writer.

Random Llama/Qwen2 weights (kvlab's `random_weights`, HF names) are stored the way llama.cpp's converter
stores them: GGUF names, Q/K rows permuted for Llama, 1-D tensors in F32, matrices in the requested ggml
types (cycled over the tensors, so one file covers several). The K-quants have no quantizer in the `gguf`
package, so those tensors get random blocks with small f16 scales (any bytes are valid K-quant data; the
dequantized values are what both kvlab and transformers then compute with). Tokenizers are trained here
with the `tokenizers` library on a small multilingual corpus: byte-level BPE ("gpt2") or a
SentencePiece-style vocabulary with byte fallback and scores ("llama").
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvlab.config import ModelConfig
from kvlab.model.weights import random_weights

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we'll see 12345 things!",
    "Le renard brun rapide saute par-dessus le chien paresseux. Ça va très bien, merci.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München!",
    "敏捷的棕色狐狸跳过了懒狗。我们今天学习自然语言处理。",
    "速い茶色の狐が怠け者の犬を飛び越える。こんにちは世界。",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "def main(argv):\n    for i in range(10):\n        print(f\"{i}: {argv[i]!r}\")\n    return 0\n",
    "if (x <= 42 && y != 0) { return x / y; } // emoji 🙂🚀 ok",
]
TEXT = ("Hello, world! Ça coûte 12,50 € — naïve café. 你好，世界。こんにちは 🙂🚀👩‍💻\n"
        "def f(x):\n    return {\"a\": [1, 2, 3], 'b': x ** 2}  # done\n\tTabs   and  spaces. <|im_end|>")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@functools.lru_cache(maxsize=None)
def byte_level_vocab(size: int = 400) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges "a b") of a byte-level BPE trained on CORPUS, specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    import json
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


@functools.lru_cache(maxsize=None)
def spm_vocab(size: int = 400) -> tuple[list[str], list[float]]:
    """(tokens, scores) of a SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces
    learned by BPE over "▁"-spaced text, scored so the earlier merge ranks higher."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    import json
    model = json.loads(tokenizer.to_str())["model"]
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for rank, piece in enumerate(p for p in pieces if p not in tokens):
        tokens.append(piece)
        scores.append(-float(rank))
    return tokens[:size], scores[:size]


def small_config(arch: str = "llama", **changes: Any) -> ModelConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                architecture="Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM",
                attention_bias=arch == "qwen2", tie_word_embeddings=arch == "qwen2", vocab_size=400)
    return ModelConfig(**{**base, **changes})


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (ggml's interleaved RoPE pairs)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


def random_k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks whose f16 scales keep the dequantized values around 1/sqrt(cols)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = {"Q2_K": 1e-3, "Q3_K": 3e-4, "Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 3e-5}[qtype] * 16 / np.sqrt(cols)
    halves = (rng.uniform(0.5, 1.0, size=(rows, cols // block, 2)) * scale).astype("<f2").view(np.uint8)
    if qtype in ("Q3_K", "Q6_K"):
        raw[..., -2:] = halves[..., :2]  # d is the last field
    elif qtype == "Q2_K":
        raw[..., -4:] = halves  # d, dmin are the last fields
    else:
        raw[..., :4] = halves  # d, dmin come first
    return raw.reshape(rows, -1)


# where each type keeps its float16 d (and dmin) in a block: (byte offset of d, offset of dmin or None)
SCALE_FIELDS = {"Q8_0": (0, None), "Q4_0": (0, None), "Q4_1": (0, 2), "Q5_0": (0, None), "Q5_1": (0, 2),
                "Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
EXTREMES = {"max": 65504.0, "subnormal": 2.0 ** -24, "small": 1e-6}


def blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scales: str) -> np.ndarray:
    """[rows, bytes] ggml blocks: llama.cpp's encoder (simple types) or random bytes (K types), then, unless
    `scales` is "normal", every block's d/dmin set to an extreme float16 ("mixed": a random one each)."""
    import gguf

    from kvlab.model.ggml_quants import BLOCK_SIZES

    if type_name.endswith("_K"):
        raw = random_k_blocks(rows, cols, type_name, rng)
    else:
        weights = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])
    if scales == "normal":
        return raw
    block, size = BLOCK_SIZES[type_name]
    b = raw.reshape(-1, size).copy()
    choices = np.array(list(EXTREMES.values()), dtype="<f2")
    for field in SCALE_FIELDS[type_name]:
        if field is None:
            continue
        values = rng.choice(choices, size=b.shape[0]) if scales == "mixed" else \
            np.full(b.shape[0], EXTREMES[scales], dtype="<f2")
        b[:, field:field + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def summation_bound(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Elementwise bound on float32 summation-order error: (K + 4) unit roundoffs of sum |x| |w|."""
    return (x.shape[1] + 4) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(weights).T) + 1e-37



def same_in_every_layer(q: str, k: str, v: str, o: str, gate: str, up: str, down: str) -> tuple[str, ...]:
    """`types` for write_gguf that give every layer of an untied Llama the same type per matrix. The file
    cycles `types` over its matrices in order (embed_tokens, lm_head, then each layer's q, k, v, o, gate,
    up, down), so a cycle of seven set at the layers' offset repeats in every layer (embed_tokens takes
    up's type, lm_head down's). Why: each q/k/v or gate/up mix is a variant of the fused decode kernels,
    compiled apart (10-30 s each, cold), and a short cycle gives every layer a mix of its own, where a
    real file (a Q4_K_M) repeats one or two."""
    by_role = (q, k, v, o, gate, up, down)
    return tuple(by_role[(i - 2) % 7] for i in range(7))


def write_gguf(path: Path, config: ModelConfig, *, tokenizer: str = "gpt2", pre: str = "qwen2",
               types: Sequence[str] = ("F32",), seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
               extra: Callable[[Any], None] | None = None, name: str = "kvlab test model",
               arch: str | None = None, metadata: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """Write a GGUF file for `config`; returns the HF-named float32 weights as *written* (dequantized).

    `arch` overrides general.architecture and `metadata` the config the metadata describes (bad files).
    """
    import gguf

    tensor_arch = {"Qwen2ForCausalLM": "qwen2"}.get(config.architecture, "llama")
    writer = gguf.GGUFWriter(str(path), arch or tensor_arch)
    tensors, config = config, metadata or config
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(0)
    if tokenizer == "gpt2":
        tokens, merges = byte_level_vocab(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_add_bos_token(False)
    else:
        tokens, scores = spm_vocab(config.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259))
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
    assert len(tokens) == config.vocab_size, (len(tokens), config.vocab_size)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if extra is not None:
        extra(writer)

    rng = np.random.default_rng(seed + 1)
    written: dict[str, np.ndarray] = {}
    matrices = 0
    config, arch = tensors, tensor_arch
    for hf, weight in random_weights(config, seed, np.float32).items():
        weight = weight.astype(np.float32)
        stored = weight
        if arch == "llama" and ".q_proj." in hf:
            stored = permute(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            stored = permute(weight, config.num_key_value_heads)
        qtype = "F32" if weight.ndim == 1 else types[matrices % len(types)]
        matrices += weight.ndim == 2
        kind = gguf.GGMLQuantizationType[qtype]
        if qtype in K_QUANTS:
            data = random_k_blocks(*stored.shape, qtype, rng)
        else:
            data = gguf.quants.quantize(stored, kind)
        writer.add_tensor(gguf_name(hf), data, raw_dtype=kind)
        back = gguf.quants.dequantize(data, kind).reshape(stored.shape).astype(np.float32)
        if arch == "llama" and ".q_proj." in hf:
            back = permute_back(back, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            back = permute_back(back, config.num_key_value_heads)
        written[hf] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def permute_back(weight: np.ndarray, heads: int) -> np.ndarray:
    return (weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def assert_cached_logits_match(model: Any, reference: Any, tokenizer: Any, prefill: int, greedy: int) -> np.ndarray:
    """`model` (weights as stored) against `reference` (the same file dequantized to float32) on 12 tokens
    of text: the full forward, then a cached prefill of `prefill` tokens and one token a step, each within
    1e-4 x (max |logit| + 1); `greedy` generated tokens identical. Returns the ids, [1, 12]."""
    import kvlab

    ids = np.array([tokenizer.encode("The quick brown fox jumps over the lazy dog")[:12]])
    want = reference.forward(ids).logits
    scale = float(np.abs(want).max()) + 1
    assert np.abs(model.forward(ids).logits - want).max() <= 1e-4 * scale
    cache = model.new_cache(1)
    steps = [model.forward(ids[:, :prefill], cache=cache).logits]
    steps += [model.forward(ids[:, i:i + 1], cache=cache).logits for i in range(prefill, ids.shape[1])]
    assert np.abs(np.concatenate(steps, axis=1) - want).max() <= 1e-4 * scale
    assert np.array_equal(kvlab.generate(model, ids, greedy), kvlab.generate(reference, ids, greedy))
    return ids
