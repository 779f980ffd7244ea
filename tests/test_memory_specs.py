"""`kvlab memory` per layer type (issue 34 item 3): sliding windows, MLA latents and constant states, sized from
config.json alone as vLLM's KV-cache specs size them, for architectures kvlab does not run too.

The published configs live in tests/data/configs/<name>/config.json (copies of the published config.json
files' fields). Layer types and state shapes are checked against transformers' own configs and caches.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import ModelConfig
from kvlab.cache.kv_spec import (FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec, kv_specs,
                                 model_config_specs)
from kvlab.cache.memory import (cache_bytes, group_bytes, kv_bytes_per_block, kv_bytes_per_token,
                                specs_tokens_in_budget, tokens_in_budget)
from kvlab.cli import main
from kvlab.errors import ConfigError

CONFIGS = Path(__file__).parent / "data" / "configs"
K, BF16 = 1024, 2


def published(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def memory_json(capsys, *argv: str) -> dict:
    assert main(["memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- the goals, on the published configs -------------------------------------------------------------
def test_gemma3_1b_at_32k_holds_a_sixth_of_full_attention(capsys):
    out = memory_json(capsys, str(CONFIGS / "gemma-3-1b"), "--tokens", "32768", "--dtype", "bfloat16")
    per_layer = 2 * 1 * 256 * BF16  # K and V, one KV head of 256
    full, sliding = [g for g in out["layer_types"] if g["type"] == "full_attention"], \
        [g for g in out["layer_types"] if g["type"] == "sliding_attention"]
    assert full[0]["layers"] == [5, 11, 17, 23]  # sliding_window_pattern 6: every 6th layer is global
    assert sliding[0]["num_layers"] == 22 and sliding[0]["sliding_window"] == 512 and sliding[0]["tokens_held"] == 512
    assert out["total_bytes"] == 4 * 32 * K * per_layer + 22 * 512 * per_layer
    assert out["kv_bytes_if_full_attention"] == 26 * 32 * K * per_layer
    assert 0.15 <= out["total_bytes"] / out["kv_bytes_if_full_attention"] <= 0.2


def test_deepseek_v3_is_one_576_wide_latent_per_token_and_layer(capsys):
    out = memory_json(capsys, str(CONFIGS / "deepseek-v3"), "--tokens", "1000", "--dtype", "bfloat16")
    assert out["sizing_only"] is True and "DeepseekV3ForCausalLM" in out["sizing_only_reason"]
    assert out["bytes_per_token"] == 61 * 576 * 2 == 70_272  # kv_lora_rank 512 + qk_rope_head_dim 64, no K/V pair
    assert out["total_bytes"] == 1000 * 61 * 576 * 2 and out["state_bytes"] == 0
    [mla] = out["layer_types"]
    assert (mla["type"], mla["num_layers"], mla["num_kv_heads"], mla["head_size"]) == ("mla", 61, 1, 576)


@pytest.mark.parametrize("tokens", [1, 127, 128, 129, 8 * K, 32 * K, 128 * K])
def test_gpt_oss_20b_is_half_of_full_plus_the_windows(tokens):
    specs = kv_specs(published("gpt-oss-20b"))
    per_layer = 2 * 8 * 64 * BF16
    everything = 24 * tokens * per_layer
    assert cache_bytes(specs, tokens, 1, "bfloat16", "bfloat16") == everything / 2 + 12 * min(tokens, 128) * per_layer
    assert [type(s[0]) for s in specs] == [SlidingWindowSpec, FullAttentionSpec] * 12


def test_qwen3_next_pays_only_its_12_full_layers_for_more_tokens(capsys):
    name = str(CONFIGS / "qwen3-next-80b-a3b")
    short, long = (memory_json(capsys, name, "--tokens", str(t), "--dtype", "bfloat16") for t in (8 * K, 40 * K))
    full_kv_per_token = 12 * 2 * 2 * 256 * BF16  # 12 layers x K,V x 2 KV heads x head_dim 256
    assert long["total_bytes"] - short["total_bytes"] == 32 * K * full_kv_per_token
    # 36 gated-delta-net layers: conv (kernel 4 - 1) x (2*16*128 + 32*128) and recurrent 32 x 128 x 128
    state = 36 * (3 * 8192 + 32 * 128 * 128) * BF16
    assert short["state_bytes"] == long["state_bytes"] == state
    linear = next(g for g in short["layer_types"] if g["type"] == "mamba")
    assert linear["num_layers"] == 36 and linear["state_shapes"] == [[3, 8192], [32, 128, 128]]
    assert short["total_bytes"] == 8 * K * full_kv_per_token + state
    with_types = {**published("qwen3-next-80b-a3b"),
                  "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]}
    assert kv_specs(with_types) == kv_specs(published("qwen3-next-80b-a3b"))  # the two spellings agree


@pytest.mark.parametrize("name,per_token,layers", [("llama-3.2-1b", 2 * 16 * 8 * 64 * BF16, 16),
                                                   ("qwen3-0.6b", 2 * 28 * 8 * 128 * BF16, 28)])
def test_full_attention_models_hold_every_token_in_every_layer(capsys, name, per_token, layers):
    out = memory_json(capsys, str(CONFIGS / name / "config.json"), "--tokens", "8192", "--dtype", "bfloat16")
    assert out["bytes_per_token"] == per_token and out["total_bytes"] == 8192 * per_token
    assert [(g["type"], g["num_layers"]) for g in out["layer_types"]] == [("full_attention", layers)]
    assert out["kv_bytes_if_full_attention"] == out["total_bytes"]


# --- layer types as transformers derives them --------------------------------------------------------------
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
             "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
             "sliding_window": 4096, "max_position_embeddings": 8192, "intermediate_size": 9216,
             "vocab_size": 256000}
MISTRAL_7B_V01 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "sliding_window": 4096, "max_position_embeddings": 32768, "intermediate_size": 14336,
                  "vocab_size": 32000}
QWEN2_WINDOWED = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
                  "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 4,
                  "intermediate_size": 64, "vocab_size": 100}


@pytest.mark.parametrize("config", [published("gemma-3-1b"), published("gpt-oss-20b"), GEMMA2_2B, QWEN2_WINDOWED,
                                    {**QWEN2_WINDOWED, "use_sliding_window": False}, published("qwen3-0.6b"),
                                    published("qwen3-next-80b-a3b")],
                         ids=["gemma3", "gpt_oss", "gemma2", "qwen2 windowed", "qwen2", "qwen3", "qwen3_next"])
def test_layer_types_match_transformers(config):
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    theirs = AutoConfig.for_model(config["model_type"], **fields).layer_types
    kinds = {FullAttentionSpec: "full_attention", SlidingWindowSpec: "sliding_attention",
             MambaSpec: "linear_attention"}
    assert [kinds[type(specs[0])] for specs in kv_specs(config)] == theirs


def test_mistral_window_is_on_every_layer_and_matches_kvlabs_own_config():
    specs = kv_specs(MISTRAL_7B_V01)
    assert set(specs) == {(SlidingWindowSpec(8, 128, 4096),)}
    assert specs == model_config_specs(ModelConfig.from_hf_dict(MISTRAL_7B_V01))
    for name in ("llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b"):  # what kvlab runs is sized by the same specs
        assert kv_specs(published(name)) == model_config_specs(ModelConfig.from_hf_dict(published(name))), name
    assert kv_specs(GEMMA2_2B) == model_config_specs(ModelConfig.from_hf_dict(GEMMA2_2B))


def test_head_dim_from_hidden_size_and_mha_without_kv_heads():
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6}
    assert kv_specs(config) == ((FullAttentionSpec(6, 16),),) * 2
    assert kv_specs({**config, "num_key_value_heads": 1, "head_dim": 40}) == ((FullAttentionSpec(1, 40),),) * 2


def test_a_multimodal_configs_text_config_is_sized():
    text = published("gemma-3-1b")
    wrapped = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
               "text_config": {k: v for k, v in text.items() if k != "architectures"}}
    assert kv_specs(wrapped) == kv_specs(text)


def test_deepseek_v2_lite_and_kimi_k2_are_mla():
    v2_lite = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "q_lora_rank": None, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048}
    assert kv_specs(v2_lite) == ((MLAAttentionSpec(1, 576),),) * 27
    kimi_k2 = {**published("deepseek-v3"), "model_type": "kimi_k2", "num_attention_heads": 64}
    assert kv_specs(kimi_k2) == ((MLAAttentionSpec(1, 576),),) * 61


# --- state shapes against transformers' own caches ----------------------------------------------------------
TINY_HYBRIDS = {
    "qwen3_next": dict(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                       linear_key_head_dim=8, linear_num_value_heads=4, linear_value_head_dim=6,
                       linear_conv_kernel_dim=4),
    "jamba": dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2),
    "granitemoehybrid": dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
                             mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                             num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=16),
    "falcon_h1": dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, mamba_d_ssm=48, mamba_n_heads=4, mamba_n_groups=1,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2),
}


@pytest.mark.parametrize("model_type", list(TINY_HYBRIDS))
def test_states_and_kv_match_what_transformers_caches(model_type):
    """Run a random tiny model of each hybrid family through transformers and compare its cache, layer by
    layer, with the specs read from the config dict transformers itself writes (to_dict). vLLM keeps
    conv_kernel - 1 columns of conv state where transformers keeps conv_kernel: that column is the only
    difference allowed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY_HYBRIDS[model_type])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(torch.arange(5)[None], use_cache=True).past_key_values
    specs = kv_specs({**config.to_dict(), "model_type": model_type})
    assert len(specs) == len(cache.layers)
    for layer, theirs in zip(specs, cache.layers):
        ours_kv = [s for s in layer if isinstance(s, FullAttentionSpec)]
        keys = getattr(theirs, "keys", None)
        if isinstance(keys, torch.Tensor):
            assert ours_kv == [FullAttentionSpec(keys.shape[1], keys.shape[3])]
            assert theirs.values.shape == keys.shape and keys.shape[2] == 5
        else:
            assert ours_kv == []
        ours_state = [s for s in layer if isinstance(s, MambaSpec)]
        conv = getattr(theirs, "conv_states", {}).get(0)
        if conv is None:
            assert ours_state == []
            continue
        [state] = ours_state
        (kernel_minus_one, conv_dim), recurrent = state.shapes
        assert (1, conv_dim, kernel_minus_one + 1) == tuple(conv.shape)
        assert sorted(recurrent) == sorted(theirs.recurrent_states[0].shape[1:])
        assert state.state_bytes("float32") == 4 * (conv.numel() - conv_dim + theirs.recurrent_states[0].numel())


def test_jamba_and_granite_published_shapes():
    jamba = {"model_type": "jamba", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
             "mamba_d_conv": 4, "mamba_expand": 2}
    specs = kv_specs(jamba)
    assert [i for i, s in enumerate(specs) if isinstance(s[0], FullAttentionSpec)] == [4, 12, 20, 28]
    assert specs[0] == (MambaSpec(((3, 8192), (8192, 16)), "mamba1"),)
    granite = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "hidden_size": 1536,
               "num_attention_heads": 12, "num_key_value_heads": 4, "layer_types": ["mamba"] * 3 + ["attention"],
               "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
               "mamba_d_conv": 4, "mamba_expand": 2}
    specs = kv_specs(granite)
    assert specs[0] == (MambaSpec(((3, 3072 + 256), (48, 64, 128)), "mamba2"),)
    assert specs[3] == (FullAttentionSpec(4, 128),)


# --- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,message", [
    ({"qk_rope_head_dim": None}, "missing field qk_rope_head_dim (needed to size MLA layers)"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive int, got 0"),
    ({"num_hidden_layers": "61"}, "num_hidden_layers must be a positive int, got str '61'"),
])
def test_a_missing_or_bad_field_is_named(change, message):
    with pytest.raises(ConfigError, match=r"^c\.json: " + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        kv_specs({**published("deepseek-v3"), **change}, source="c.json")


def test_unknown_layer_types_and_states_are_refused():
    gpt_oss = published("gpt-oss-20b")
    with pytest.raises(ConfigError, match=r"layer_types\[3\] 'chunked_attention' is not a layer type kvlab can size"):
        kv_specs({**gpt_oss, "layer_types": gpt_oss["layer_types"][:3] + ["chunked_attention"] * 21})
    with pytest.raises(ConfigError, match="layer_types must be a list of 24 names"):
        kv_specs({**gpt_oss, "layer_types": gpt_oss["layer_types"][:3]})
    with pytest.raises(ConfigError, match="missing field sliding_window"):
        kv_specs({**gpt_oss, "sliding_window": None})
    with pytest.raises(ConfigError, match="model_type 'llama' has linear-attention/Mamba layers"):
        kv_specs({"model_type": "llama", "num_hidden_layers": 1, "layer_types": ["linear_attention"]})
    with pytest.raises(ConfigError, match="missing field linear_num_value_heads"):
        kv_specs({k: v for k, v in published("qwen3-next-80b-a3b").items() if k != "linear_num_value_heads"})


def test_the_cli_refuses_in_one_line_naming_the_field(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**published("deepseek-v3"), "qk_rope_head_dim": None}))
    assert main(["memory", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "qk_rope_head_dim" in err and "Traceback" not in err
    assert main(["memory", str(path), "--config", str(path)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["memory", str(CONFIGS / "qwen3-next-80b-a3b"), "--state-dtype", "int8"]) == 2
    assert "--state-dtype must be a float dtype" in capsys.readouterr().err


# --- budgets, blocks and what kvlab runs ---------------------------------------------------------------------
def test_existing_sizing_of_full_attention_configs_is_unchanged():
    config = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=8, num_hidden_layers=3,
                         num_attention_heads=10, num_key_value_heads=5, head_dim=64)
    assert kv_bytes_per_token(config, "int4") == 2 * 3 * 5 * 64 / 2 and kv_bytes_per_token(config, "bf16") == 3840
    assert kv_bytes_per_block(config, 16, "int8") == 16 * (1920 + 2 * 3 * 5 * 2 * 4)  # + a scale/zero per 32
    specs = model_config_specs(config)
    for budget in (0, 1, 10**6, 123_456_789):
        fit = specs_tokens_in_budget(specs, budget, 3, "int4", "float32")
        assert fit == tokens_in_budget(config, budget, 3, "int4")


def test_total_bytes_counts_int8_scales(capsys):
    out = memory_json(capsys, "--tokens", "10", "--dtype", "int8")  # the tiny seed model: head_dim 8
    assert out["total_bytes"] == 10 * (out["bytes_per_token"] + out["scale_bytes_per_token"]) > 10 * 64


spec_strategy = st.one_of(
    st.builds(FullAttentionSpec, st.integers(1, 4), st.sampled_from([8, 32, 64])),
    st.builds(SlidingWindowSpec, st.integers(1, 4), st.sampled_from([8, 32]), st.integers(1, 300)),
    st.builds(MLAAttentionSpec, st.just(1), st.sampled_from([64, 576])),
    st.builds(MambaSpec, st.just(((3, 16), (4, 8, 8))), st.just("mamba2")))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(spec_strategy, min_size=1, max_size=2).map(tuple), min_size=1, max_size=5).map(tuple),
       st.integers(0, 10**7), st.integers(1, 4), st.sampled_from(["bfloat16", "int4", "int8", "fp8"]))
def test_tokens_in_budget_is_the_most_that_fits(specs, budget, batch, dtype):
    fit = specs_tokens_in_budget(specs, budget, batch, dtype, "float32")
    cost = lambda tokens: cache_bytes(specs, tokens, batch, dtype, "float32")  # noqa: E731
    if fit is None:  # nothing grows without bound, and the biggest it gets fits
        assert all(s.tokens_held(10**9) < 10**9 for layer in specs for s in layer if s.bytes_per_token(dtype))
        assert cost(10**9) <= budget
    else:
        assert (fit == 0 or cost(fit) <= budget) and cost(fit + 1) > budget


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(1, 120))
def test_sliding_blocks_held_follow_vllms_free_rule(window, block_size, length):
    """Decode token by token, freeing the blocks wholly before num_computed - window + 1 before each step
    (vLLM's SlidingWindowManager.get_num_skipped_tokens): what is left is blocks_held, and it covers the
    window of the query being computed."""
    spec = SlidingWindowSpec(1, 8, window)
    held: set[int] = set()
    for computed in range(length):
        skipped = max(0, computed - window + 1)
        held = {b for b in held if (b + 1) * block_size > skipped} | {computed // block_size}
        assert len(held) == spec.blocks_held(computed + 1, block_size)
        assert all(p // block_size in held for p in range(max(0, computed - window + 1), computed + 1))
    assert spec.tokens_held(length) == min(length, window)
    assert FullAttentionSpec(1, 8).blocks_held(length, block_size) == -(-length // block_size)


def test_group_bytes_split_kv_and_state():
    specs = kv_specs(published("qwen3-next-80b-a3b"))
    rows = group_bytes(specs, 100, 2, "bfloat16", "float32")
    state = next(r for r in rows if isinstance(r.group.spec, MambaSpec))
    attention = next(r for r in rows if isinstance(r.group.spec, FullAttentionSpec))
    assert state.kv_bytes == 0 and state.state_bytes == 2 * 36 * (3 * 8192 + 32 * 128 * 128) * 4
    assert attention.state_bytes == 0 and attention.kv_bytes == Fraction(2 * 100 * 12 * 2 * 2 * 256 * 2)
    assert attention.group.layers == tuple(range(3, 48, 4))


def test_human_output_says_sizing_only_and_shows_layer_types(capsys):
    assert main(["memory", str(CONFIGS / "gpt-oss-20b" / "config.json"), "--tokens", "4096",
                 "--dtype", "bf16"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "sizing only" in text and "GptOssForCausalLM" in text
    assert "by layer type" in text and "window 128" in text and "this holds 0.516 of it" in text
    assert main(["memory", str(CONFIGS / "llama-3.2-1b"), "--tokens", "4096"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "sizing only" not in text and "by layer type" not in text
