"""Tiny random checkpoints of the newer families, written by transformers' own `save_pretrained`.

Every parameter is randomized (norm weights and biases too, around Gemma's 0 or the others' 1), so a
norm in the wrong place, a swapped q/k norm or a missing (1 + w) moves logits by O(1). Shapes are tiny
(hidden 64, 4 layers) and float32; the tokenizer is test_hf_parity's 320-token byte-level BPE.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=0, eos_token_id=1, pad_token_id=1)

# name -> (architecture, config class, config changes)
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 24, "tie_word_embeddings": False}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {"no_rope_layer_interval": 2,
                                                        "no_rope_layers": None, "tie_word_embeddings": True}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {
        "max_position_embeddings": 96, "original_max_position_embeddings": 48,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5],
                            "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {
        "head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 6, "tie_word_embeddings": False, "layer_types":
        ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}}}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {
        "head_dim": 16, "query_pre_attn_scalar": 12, "sliding_window": 6, "attn_logit_softcapping": 5.0,
        "tie_word_embeddings": False,
        "final_logit_softcapping": 30.0}),
}


def randomize_all(model, torch, gemma: bool) -> None:
    """Every parameter away from its init: matrices N(0, 1/fan_in) (output products 3x), embeddings
    N(0, 1), biases N(0, 0.1), norms N(1, 0.3) (Gemma's (1 + w) norms N(0, 0.3))."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(3.0 * noise / p.shape[-1] ** 0.5)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def make_family_checkpoint(folder: Path, name: str, **changes) -> Path:
    import torch
    import transformers
    from test_hf_parity import build_tokenizer

    architecture, config_class, family = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**BASE, **family, **changes})
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    randomize_all(model, torch, gemma=name.startswith("gemma"))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def reference(folder: Path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    return model


def transformers_run(folder: Path, ids: np.ndarray, new_tokens: int) -> dict[str, np.ndarray]:
    """Logits over the prompt, greedy tokens and the logits each greedy step chose from."""
    import torch

    ref = reference(folder)
    prompt = torch.from_numpy(ids)
    with torch.no_grad():
        logits = ref(prompt).logits.numpy()
        run = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           do_sample=False, output_logits=True, return_dict_in_generate=True)
    return {"logits": logits, "tokens": run.sequences[0, ids.shape[1]:].numpy(),
            "steps": torch.cat(run.logits).numpy()}


def kvlab_run(model, ids: np.ndarray, new_tokens: int) -> dict[str, np.ndarray]:
    """The same three from kvlab: a full forward, a greedy run, and each step's logits (prefill + decode)."""
    import kvlab

    tokens = kvlab.generate(model, ids, new_tokens)[0]
    cache = model.new_cache()
    steps = [model.forward(ids, cache=cache, logits_to_keep=1).logits[0, -1]]
    steps += [model.forward([[t]], cache=cache).logits[0, -1] for t in tokens[:-1]]
    return {"logits": model.forward(ids).logits, "tokens": tokens, "steps": np.stack(steps)}


def parity_errors(got: dict, want: dict) -> dict[str, float]:
    """max |error| / (max |logit| + 1) of the prompt logits and of the greedy steps' logits."""
    scale = float(np.abs(want["logits"]).max()) + 1.0
    return {"prompt": float(np.abs(got["logits"] - want["logits"]).max()) / scale,
            "steps": float(np.abs(got["steps"] - want["steps"]).max()) / (float(np.abs(want["steps"]).max()) + 1)}


def config_json(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())
