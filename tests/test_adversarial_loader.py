"""Model folders a user might really have: every config field wrong, files that are folders or symlink loops,
truncated or non-finite tensors. `kvlab.load` must raise ConfigError / CheckpointError naming the file and
the field or tensor, and leave the folder byte for byte as it was.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kvlab
from adversarial import refuses, tree_state
from kvlab.hf.safetensors import save_file
from test_hf_loader import CONFIG, write_folder


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("good") / "model"
    write_folder(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    kvlab.load(folder)  # the unbent folder loads
    return folder


@pytest.fixture
def copy(good, tmp_path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "model", symlinks=True))


def refuses_folder(folder: Path, match: str | None = None) -> str:
    before = tree_state(folder)
    error = refuses(lambda: kvlab.load(folder))
    assert tree_state(folder) == before
    if match is not None:
        assert match in str(error), str(error)
    return str(error)


# Each field of config.json with values of the wrong type or out of range (None only where null is invalid).
FIELD_VALUES = {
    "vocab_size": ["300", None, [300], 0, -1, 300.5, True],
    "hidden_size": ["32", None, 0, -32, 32.5, {"n": 32}],
    "intermediate_size": ["64", None, 0, -1, 1e400],
    "num_hidden_layers": ["2", None, 0, -2, 2.5, False],
    "num_attention_heads": ["4", 0, 3, -4],
    "num_key_value_heads": ["2", 0, 3, -2, 2.0, [2]],
    "head_dim": ["8", 0, 7, -8, 8.5],
    "max_position_embeddings": ["64", None, 0, -64, 1e400],
    "rms_norm_eps": ["1e-6", None, 0, -1e-6, 1e400, [1e-6]],
    "rope_theta": ["10000", None, 0, -10000, 1e400, 1e-320, [10000]],
    "rope_scaling": [[1, 2], "linear", 5, {"rope_type": "linear", "factor": 0},
                     {"rope_type": "linear", "factor": -1}, {"rope_type": "linear", "factor": "2"},
                     {"rope_type": "linear"}, {"type": "dynamic", "factor": 2.0},
                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}],
    "rope_parameters": ["x", [1], {"rope_type": "default", "rope_theta": 0},
                        {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.0}],
    "tie_word_embeddings": ["false", "true", 0, 1, None],
    "attention_bias": ["false", 1],
    "mlp_bias": ["false", 1],
    "bos_token_id": [-1, "0", 0.5, [0.5]],
    "eos_token_id": [-1, "1", [1, "x"], [-1], 1.5, {"id": 1}],
    "architectures": ["LlamaForCausalLM", [5], ["GPT2LMHeadModel"], {"a": 1}],
    "model_type": [["llama"]],
    "hidden_act": ["gelu", None, 5],
}
CASES = [(field, value) for field, values in FIELD_VALUES.items() for value in values]


@pytest.mark.parametrize("field,value", CASES, ids=[f"{f}={json.dumps(v)}"[:50] for f, v in CASES])
def test_each_config_field_wrong_is_refused_by_name(copy, field, value):
    raw = json.loads((copy / "config.json").read_text())
    raw[field] = value
    if field == "model_type":
        raw.pop("architectures")
    (copy / "config.json").write_text(json.dumps(raw))  # 1e400 is written as Infinity
    message = refuses_folder(copy)
    assert "config.json" in message, message
    names = {"rope_parameters": "rope", "rope_scaling": "rope", "architectures": "architecture",
             "model_type": "architecture", "mlp_bias": "mlp_bias"}
    assert names.get(field, field) in message or (isinstance(value, float) and value > 1e300
                                                  and "Infinity" in message), message


def test_config_values_parsed_from_json_overflow_are_refused(copy):
    """`1e400` in JSON is legal and parses to inf: rope_theta inf gives NaN logits, so it is refused."""
    text = (copy / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": 1e400')
    assert "1e400" in text
    (copy / "config.json").write_text(text)
    refuses_folder(copy, "rope_theta")


FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json"]


@pytest.mark.parametrize("name", FILES)
def test_a_file_that_is_a_folder(copy, name):
    (copy / name).unlink()
    (copy / name).mkdir()
    refuses_folder(copy, name)


@pytest.mark.parametrize("name", FILES)
def test_a_file_that_is_a_symlink_loop(copy, name):
    (copy / name).unlink()
    (copy / name).symlink_to(copy / name)
    refuses_folder(copy, name)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja"])
@pytest.mark.parametrize("content", [b"\x00\x01binary\xff", "caf\xe9".encode("latin-1"), b"{",
                                     b"[1, 2]", b'{"a": NaN}'])
def test_text_files_that_are_not_json_objects_or_text(copy, name, content):
    if name == "chat_template.jinja" and content in (b"{", b"[1, 2]", b'{"a": NaN}'):
        pytest.skip("valid text is a valid template source")
    (copy / name).write_bytes(content)
    refuses_folder(copy, name)


def test_the_model_folder_itself(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for path in (tmp_path / "missing", tmp_path / "file", tmp_path / "loop", tmp_path, ""):
        refuses(lambda: kvlab.load(path))
    refuses(lambda: kvlab.load(5))
    refuses(lambda: kvlab.load(CONFIG))


@pytest.mark.parametrize("cut", [0, 4, 8, 20, "header", "payload", "last byte"])
def test_truncated_weights(copy, cut):
    path = copy / "model.safetensors"
    blob = path.read_bytes()
    header = 8 + int.from_bytes(blob[:8], "little")
    keep = {"header": header - 3, "payload": header + (len(blob) - header) // 2,
            "last byte": len(blob) - 1}.get(cut, cut)
    path.write_bytes(blob[:keep])
    refuses_folder(copy, "model.safetensors")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused_with_the_tensor_named(copy, dtype, value):
    from kvlab.hf.safetensors import load_file

    weights = {name: np.array(array, dtype=dtype)
               for name, array in load_file(copy / "model.safetensors").items()}
    weights["model.layers.1.self_attn.k_proj.weight"][2, 3] = value
    save_file(weights, copy / "model.safetensors")
    message = refuses_folder(copy, "model.layers.1.self_attn.k_proj.weight")
    assert "(2, 3)" in message


def test_float16_weights_whose_sum_overflows_still_load(copy):
    """The finiteness check sums each tensor first: an overflowing sum of finite halves is not a NaN."""
    from kvlab.hf.safetensors import load_file

    weights = {name: np.array(array, dtype=np.float16)
               for name, array in load_file(copy / "model.safetensors").items()}
    weights["model.embed_tokens.weight"][:] = 60000.0  # finite in float16; the sum is not
    save_file(weights, copy / "model.safetensors")
    model, _ = kvlab.load(copy)
    assert np.isfinite(model.embed).all()


@pytest.mark.parametrize("index", [
    {"weight_map": [1, 2]}, {"weight_map": {"model.norm.weight": 5}}, [1], {"weight_map": None},
    {"weight_map": {"model.norm.weight": "../model.safetensors"}},
    {"weight_map": {"model.norm.weight": "missing.safetensors"}},
])
def test_bad_shard_index(copy, index):
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    refuses_folder(copy, "safetensors")
