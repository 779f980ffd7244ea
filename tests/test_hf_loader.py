"""Loading HF folders: the safetensors reader against the reference package, and every kind of bad input.

Folders here are written by kvlab itself (config.json from ModelConfig, weights with kvlab.hf.safetensors,
a tokenizer trained with `tokenizers`), so these tests need neither torch nor transformers. A bad folder
must raise CheckpointError or ConfigError naming the file (and the tensor or field) and leave nothing
half-loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np
import pytest

import kvlab
from kvlab.config import ModelConfig
from kvlab.errors import CheckpointError, ConfigError, ContextLengthError
from kvlab.hf import loader
from kvlab.hf.safetensors import load_file, read_header, save_file
from kvlab.model.weights import random_weights

CONFIG = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=0, eos_token_id=1)
TEXT = "Now is the winter of our discontent made glorious summer by this sun of York; façade 😀."


def save_sharded(tensors: Mapping[str, np.ndarray], folder: str | Path, max_shard_bytes: int | None = None,
                 metadata: Mapping[str, str] | None = None) -> list[Path]:
    """Write `model.safetensors`, or shards plus `model.safetensors.index.json` as transformers names them.

    Tensors go to shards in name order; a shard is closed once it would exceed `max_shard_bytes`.
    """
    folder = Path(folder)
    names = sorted(tensors)
    total = sum(np.asarray(tensors[n]).nbytes for n in names)
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, folder / "model.safetensors", metadata)
        return [folder / "model.safetensors"]
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = np.asarray(tensors[name]).nbytes
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    paths, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        path = folder / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, path, metadata)
        weight_map.update({n: path.name for n in group})
        paths.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def write_tokenizer(folder: Path, vocab_size: int = 300, **tokenizer_config) -> None:
    """A byte-level BPE with <s> (0) and </s> (1), plus tokenizer_config.json (add_bos_token by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, **tokenizer_config}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def write_folder(folder: Path, config: ModelConfig = CONFIG, dtype=np.float32, seed: int = 0,
                 max_shard_bytes: int | None = None, tokenizer: bool = True) -> dict[str, np.ndarray]:
    """An HF model folder written without transformers; returns the weights as saved."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    weights = {k: v.astype(dtype) for k, v in random_weights(config, seed, np.float64).items()}
    save_sharded(weights, folder, max_shard_bytes)
    if tokenizer:
        write_tokenizer(folder, config.vocab_size)
    return weights


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_folder(tmp_path / "model")
    return tmp_path / "model"


# --- safetensors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int64])
def test_safetensors_round_trip_and_reference_reader(tmp_path, dtype):
    st_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {"a": (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype), "b": np.ones(7, dtype),
               "scalar": np.array(3, dtype)}
    save_file(tensors, tmp_path / "x.safetensors", {"format": "np"})
    back = load_file(tmp_path / "x.safetensors")
    reference = st_numpy.load_file(tmp_path / "x.safetensors")  # the reference parser reads our file
    for name, array in tensors.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        np.testing.assert_array_equal(back[name], array)
        np.testing.assert_array_equal(reference[name], array)
    assert read_header(tmp_path / "x.safetensors").metadata == {"format": "np"}
    # and we read what the reference writer wrote
    st_numpy.save_file({"w": np.linspace(0, 1, 10, dtype=np.float32)}, tmp_path / "y.safetensors")
    np.testing.assert_array_equal(load_file(tmp_path / "y.safetensors")["w"], np.linspace(0, 1, 10, dtype=np.float32))


def test_tensors_are_memory_mapped_not_read(tmp_path):
    save_file({"w": np.ones((256, 256), np.float32)}, tmp_path / "w.safetensors")
    w = load_file(tmp_path / "w.safetensors")["w"]
    assert isinstance(w.base, np.memmap) or isinstance(getattr(w.base, "base", None), np.memmap)
    assert not w.flags.writeable


def _raw_file(path: Path, header: object, payload: bytes, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + raw + payload)
    return path


@pytest.mark.parametrize("case, match", [
    ("short", "no header length"),
    ("huge_length", "bad safetensors header length"),
    ("bad_json", "not valid JSON"),
    ("not_object", "must be a JSON object"),
    ("past_end", "past the end of the file"),
    ("unknown_dtype", "unknown or unsupported dtype 'Q4'"),
    ("span_mismatch", "spans 8 bytes but shape"),
    ("bad_shape", "malformed shape"),
    ("overlap", "overlap"),
])
def test_corrupt_safetensors_files_are_refused_by_name(tmp_path, case, match):
    path = tmp_path / f"{case}.safetensors"
    good = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    if case == "short":
        path.write_bytes(b"\x10\x00")
    elif case == "huge_length":
        _raw_file(path, good, bytes(16), length=10_000)
    elif case == "bad_json":
        _raw_file(path, b'{"w": {"dtype": "F32", ', bytes(16))
    elif case == "not_object":
        _raw_file(path, [1, 2], bytes(16))
    elif case == "past_end":
        _raw_file(path, good, bytes(12))  # truncated payload
    elif case == "unknown_dtype":
        _raw_file(path, {"w": {"dtype": "Q4", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16))
    elif case == "span_mismatch":
        _raw_file(path, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}, bytes(16))
    elif case == "bad_shape":
        _raw_file(path, {"w": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}}, bytes(16))
    elif case == "overlap":
        _raw_file(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match=match) as info:
        load_file(path)
    assert str(path) in str(info.value)


# --- loading -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_loaded_model_computes_what_its_weights_say(tmp_path, dtype):
    weights = write_folder(tmp_path / "m", dtype=dtype)
    model, tokenizer = kvlab.load(tmp_path / "m", weights_dtype="float32")
    direct = kvlab.LlamaModel(CONFIG, weights={k: v.astype(np.float32) for k, v in weights.items()})
    ids = np.array([tokenizer.encode(TEXT)[:20]])
    np.testing.assert_array_equal(model.forward(ids).logits, direct.forward(ids).logits)
    assert model.fingerprint == direct.fingerprint
    assert model.dtype == np.float32
    # By default (weights_dtype="auto") half-precision matrices stay as stored; the math is still float32
    kept, _ = kvlab.load(tmp_path / "m")
    assert kept.weights_dtype == np.dtype(dtype) and kept.dtype == np.float32
    assert np.abs(kept.forward(ids).logits - direct.forward(ids).logits).max() <= 1e-5


def test_sharded_folder_loads_like_the_single_file(tmp_path):
    write_folder(tmp_path / "one")
    write_folder(tmp_path / "many", max_shard_bytes=20_000)
    assert len(list((tmp_path / "many").glob("model-*.safetensors"))) >= 3
    one = kvlab.hf.load_model(tmp_path / "one")
    many = kvlab.hf.load_model(tmp_path / "many")
    assert one.fingerprint == many.fingerprint


def test_float64_compute(folder):
    model = kvlab.hf.load_model(folder, dtype="float64")
    assert model.dtype == np.float64
    ids = np.arange(2, 30)[None]
    cache = model.new_cache()
    model.forward(ids[:, :11], cache=cache)
    np.testing.assert_allclose(model.forward(ids[:, 11:], cache=cache).logits, model.forward(ids).logits[:, 11:],
                               atol=1e-10, rtol=0)


def test_kv_cache_dtype_is_selectable(folder):
    model, tokenizer = kvlab.load(folder)
    ids = np.array([tokenizer.encode(TEXT)[:16]])
    for name in ("float32", "float16", "bfloat16"):
        cache = model.new_cache(kv_dtype=name)
        model.forward(ids, cache=cache)
        assert cache.dtype.name == name and cache[0][0].dtype.name == name
    tokens = kvlab.generate(model, ids, 5, kv_dtype="bfloat16")
    assert tokens.shape == (1, 5)


def test_default_model_dir_is_exposed_and_missing_is_clear(tmp_path, monkeypatch):
    assert kvlab.hf.DEFAULT_MODEL_DIR == Path(kvlab.__file__).parent / "models" / "shakespeare"
    monkeypatch.setattr(loader, "DEFAULT_MODEL_DIR", tmp_path / "not-trained-yet")
    with pytest.raises(CheckpointError, match="default model is not available"):
        kvlab.load()


def test_default_model_ships_and_loads():
    assert (kvlab.hf.DEFAULT_MODEL_DIR / "config.json").is_file()  # package data: it must ship
    model, tokenizer = kvlab.load()
    ids = tokenizer.encode("ROMEO:")
    assert ids[0] == tokenizer.bos_token_id
    new = kvlab.generate(model, [ids], 8)[0]
    assert len(new) == 8
    assert new[0] == int(np.argmax(model.forward(np.array([ids])).logits[0, -1]))  # greedy by default
    assert tokenizer.decode(new).strip()  # real text, not nothing


# --- bad folders ---------------------------------------------------------------------------------------------
def test_missing_folder_and_files(tmp_path, folder):
    with pytest.raises(CheckpointError, match="no such model folder"):
        kvlab.load(tmp_path / "nope")
    (folder / "config.json").rename(folder / "config.json.bak")
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        kvlab.load(folder)
    (folder / "config.json.bak").rename(folder / "config.json")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        kvlab.load(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        kvlab.hf.load_model(folder)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(CheckpointError, match="pickle"):
        kvlab.hf.load_model(folder)


def test_bad_config_json(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        kvlab.load(folder)


def test_unknown_architecture_lists_the_supported_ones(folder):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        kvlab.load(folder)


def test_shapes_that_disagree_with_the_config_name_file_and_tensor(folder):
    raw = json.loads((folder / "config.json").read_text())
    raw["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' "
                                              r"has shape \(32, 64\) but the config implies \(32, 96\)"):
        kvlab.load(folder)


def test_missing_and_unexpected_tensors(folder):
    weights = dict(load_file(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "model.norm.weight"}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing tensor 'model\.norm\.weight'"):
        kvlab.load(folder)
    save_file({**weights, "model.layers.9.extra.weight": np.zeros(2, np.float32)}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.9\.extra\.weight'"):
        kvlab.load(folder)
    save_file({**weights, "model.norm.weight": np.zeros(32, np.int32)}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="is int32; weights must be float"):
        kvlab.load(folder)


def test_truncated_weight_file_in_a_folder(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor .* past the end of the file"):
        kvlab.load(folder)


def test_broken_shard_index(tmp_path):
    write_folder(tmp_path / "m", max_shard_bytes=20_000)
    folder = tmp_path / "m"
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"{shards[1].name}: file not found"):
        kvlab.load(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = next(k for k, v in index["weight_map"].items() if v == shards[0].name)
    index["weight_map"] = {k: (shards[0].name if v == shards[1].name else v) for k, v in index["weight_map"].items()}
    index["weight_map"]["model.extra"] = shards[0].name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="listed in model.safetensors.index.json but missing from the file"):
        kvlab.load(folder)
    assert name  # the first shard is intact; the error names what is wrong, not the first file


def test_failed_set_weights_leaves_the_model_as_it_was(folder):
    model = kvlab.hf.load_model(folder)
    before = model.fingerprint
    ids = np.arange(3, 13)[None]
    logits = model.forward(ids).logits
    bad = dict(load_file(folder / "model.safetensors"))
    bad["model.layers.1.self_attn.q_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(CheckpointError, match="q_proj.weight.*config.json|q_proj.weight' has shape"):
        model.set_weights(bad, source="config.json")
    assert model.fingerprint == before
    np.testing.assert_array_equal(model.forward(ids).logits, logits)


def test_prompt_longer_than_the_context(folder):
    model, tokenizer = kvlab.load(folder)
    ids = np.array([(tokenizer.encode(TEXT) * 10)[:65]])
    with pytest.raises(ContextLengthError, match="max_position_embeddings"):
        model.forward(ids)
    from kvlab.cli.generate import check_prompt
    with pytest.raises(ContextLengthError, match="the prompt is 65 tokens but the model's context is 64"):
        check_prompt(ids[0].tolist(), model.config.max_position_embeddings)


def test_tokenizer_files_that_do_not_agree(folder):
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: eos_token '<\|nope\|>' is not in"):
        kvlab.load(folder)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot be read"):
        kvlab.load(folder)


def test_copy_of_folder_elsewhere_loads(tmp_path, folder):
    shutil.copytree(folder, tmp_path / "copy")
    assert kvlab.hf.load_model(tmp_path / "copy").fingerprint == kvlab.hf.load_model(folder).fingerprint
