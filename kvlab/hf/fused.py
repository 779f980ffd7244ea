"""Checkpoints that store q/k/v or gate/up as one matrix (Phi-3/4: `qkv_proj`, `gate_up_proj`).

kvlab names weights the Llama way (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`), so a fused
checkpoint is checked under its own names (`stored_shapes`) and split by rows right after reading
(`split_fused`): q rows, then k, then v; gate rows, then up (Phi3MLP's `chunk(2)`). The model stacks
them again when it fuses its layers, so the split costs one copy at load and nothing per step.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvlab.config import ModelConfig

FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


def _parts(config: ModelConfig) -> list[tuple[str, list[tuple[str, int]]]]:
    """(fused name suffix, [(part suffix, rows)]) per layer kind of fused matrix."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return [("self_attn.qkv_proj.weight", [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                           ("self_attn.v_proj.weight", kv)]),
            ("mlp.gate_up_proj.weight", [("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)])]


def stored_shapes(config: ModelConfig, shapes: Mapping[str, tuple]) -> dict[str, tuple]:
    """`shapes` (kvlab's names) as the checkpoint of `config`'s architecture names them."""
    if config.architecture not in FUSED_ARCHITECTURES:
        return dict(shapes)
    out = dict(shapes)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for fused, parts in _parts(config):
            if all(p + part in out for part, _ in parts):
                rows = sum(out.pop(p + part)[0] for part, _ in parts)
                out[p + fused] = (rows, config.hidden_size)
    return out


def split_fused(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` with every fused matrix split into kvlab's names (views of its rows); others as they are."""
    if config.architecture not in FUSED_ARCHITECTURES:
        return weights
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for fused, parts in _parts(config):
            if p + fused not in weights:
                continue
            matrix, row = weights.pop(p + fused), 0
            for part, rows in parts:
                weights[p + part] = matrix[row:row + rows]
                row += rows
    return weights
