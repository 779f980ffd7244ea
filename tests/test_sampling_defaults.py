"""Sampling defaults: flags win, then the model's generation_config.json, then llama.cpp's defaults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.sampling.defaults import LLAMA_CPP_DEFAULTS, ModelSampling, resolve_sampling
from kvlab.errors import ConfigError, InputError
from kvlab.loader import model_sampling
from test_hf_loader import write_folder

NONE = {"temperature": None, "top_k": None, "top_p": None, "min_p": None}


def test_no_flags_and_no_recommendation_means_llama_cpp_defaults():
    resolved = resolve_sampling(NONE)
    assert resolved.values == LLAMA_CPP_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert resolved.summary() == "temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (llama.cpp defaults)"


def test_the_recommendation_applies_and_the_rest_is_neutral_as_in_vllm():
    model = ModelSampling({"temperature": 0.2, "top_p": 0.9}, "generation_config.json", ("repetition_penalty",))
    resolved = resolve_sampling(NONE, model)
    assert resolved.values == {"temperature": 0.2, "top_k": 0, "top_p": 0.9, "min_p": 0.0}
    assert resolved.summary() == "temperature 0.2, top_p 0.9 (generation_config.json + neutral)"
    assert "not applied (kvlab has no such sampler setting): repetition_penalty" in resolved.describe()


@given(flags=st.fixed_dictionaries({
    # temperatures in (0, 1e-5) are refused by SamplingParams (logits / temperature overflows)
    "temperature": st.none() | st.just(0.0) | st.floats(1e-5, 2), "top_k": st.none() | st.integers(-1, 100),
    "top_p": st.none() | st.floats(0.01, 1), "min_p": st.none() | st.floats(0, 1)}),
    recommended=st.dictionaries(st.sampled_from(["temperature", "top_k", "top_p", "min_p"]),
                                st.just(0.5), max_size=4))
def test_flags_always_win_per_setting(flags, recommended):
    recommended = {k: (5 if k == "top_k" else v) for k, v in recommended.items()}
    model = ModelSampling(recommended, "generation_config.json") if recommended else None
    resolved = resolve_sampling(flags, model)
    for key, value in flags.items():
        if value is not None:
            assert resolved.values[key] == value and resolved.origins[key] == "flag"
        elif key in recommended:
            assert resolved.values[key] == recommended[key] and resolved.origins[key] == "generation_config.json"
        else:
            assert resolved.origins[key] == ("neutral" if recommended else "llama.cpp defaults")


def test_bad_flags_are_refused():
    with pytest.raises(InputError, match="top_p"):
        resolve_sampling({**NONE, "top_p": 0.0})
    with pytest.raises(InputError, match="temperature"):
        resolve_sampling({**NONE, "temperature": -1.0})


def test_generation_config_json_of_an_hf_folder(tmp_path):
    write_folder(tmp_path / "m")
    assert model_sampling(tmp_path / "m") is None  # no file
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
         "min_p": None, "eos_token_id": 1}))
    found = model_sampling(tmp_path / "m")
    assert found == ModelSampling({"temperature": 0.7, "top_k": 20, "top_p": 0.8}, "generation_config.json",
                                  ("repetition_penalty",))
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"top_k": "many"}))
    with pytest.raises(ConfigError, match=r"generation_config.json: top_k must be a number, got 'many'"):
        model_sampling(tmp_path / "m")


def test_the_shipped_model_has_no_recommendation_so_llama_cpp_defaults_apply():
    if not (kvlab.hf.DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("the default model is not built")
    assert model_sampling(None) is None
    out = subprocess.run([sys.executable, "-m", "kvlab.cli", "generate", "ROMEO:", "-n", "4"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "sampling: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (llama.cpp defaults)" in out.stderr


def test_generate_follows_a_folders_generation_config(tmp_path):
    folder = tmp_path / "m"
    write_folder(folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    out = subprocess.run([sys.executable, "-m", "kvlab.cli", "generate", "--model", str(folder), "winter", "-n",
                          "6", "--ignore-eos", "--no-display-prompt"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    model, tokenizer = kvlab.load(folder)
    assert out.stdout == tokenizer.decode(kvlab.generate(model, [tokenizer.encode("winter")], 6)[0]) + "\n"
    assert "sampling: greedy (generation_config.json + neutral)" in out.stderr
