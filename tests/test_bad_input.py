"""Bad input gets an error that names the problem and leaves the cache exactly as it was."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab import (CacheMismatchError, ConfigError, ContextLengthError, InputError, ModelConfig, TinyLlama,
                   generate)


@pytest.fixture()
def model():
    return TinyLlama(seed=7, max_position_embeddings=32)


def snapshot(cache):
    return (cache.get_seq_length(), cache.positions.copy(), [(k.copy(), v.copy()) for k, v in cache],
            cache.store.capacity_tokens)


def assert_unchanged(cache, snap):
    length, positions, arrays, capacity = snap
    assert cache.get_seq_length() == length
    np.testing.assert_array_equal(cache.positions, positions)
    for (k, v), (k0, v0) in zip(cache, arrays):
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)
    assert cache.store.capacity_tokens == capacity


BAD_IDS = [
    (np.array([[1, 260]]), InputError, "outside the vocabulary"),
    (np.array([[-1, 2]]), InputError, "token id -1"),
    (np.array([[1.0, 2.0]]), InputError, "must be integers"),
    (np.array([[True, False]]), InputError, "must be integers"),
    (np.array([1, 2, 3]), InputError, "2-D"),
    (np.ones((1, 1, 2), dtype=int), InputError, "2-D"),
    (np.zeros((1, 0), dtype=int), InputError, "empty"),
    ([[1, 2], [3]], InputError, "rectangular|integers"),
    ("hello", InputError, "2-D"),
]


@pytest.mark.parametrize("ids,error,message", BAD_IDS)
def test_bad_ids_raise_and_leave_the_cache(model, ids, error, message):
    cache = model.forward(np.array([[1, 2, 3]]), use_cache=True).cache
    snap = snapshot(cache)
    with pytest.raises(error, match=message):
        model.forward(ids, cache=cache)
    assert_unchanged(cache, snap)


def test_positions_past_the_context_are_refused(model):
    cache = model.forward(np.array([list(range(30))]), use_cache=True).cache
    snap = snapshot(cache)
    with pytest.raises(ContextLengthError, match=r"positions 30..32 exceed the model's context of 32"):
        model.forward(np.array([[1, 2, 3]]), cache=cache)
    assert_unchanged(cache, snap)
    with pytest.raises(ContextLengthError):
        model.forward(np.zeros((1, 33), dtype=int))


def test_batch_mismatch_is_refused(model):
    cache = model.forward(np.array([[1, 2], [3, 4]]), use_cache=True).cache
    snap = snapshot(cache)
    with pytest.raises(CacheMismatchError, match="batch size 1 but the cache holds 2"):
        model.forward(np.array([[5]]), cache=cache)
    assert_unchanged(cache, snap)


def test_foreign_cache_and_non_cache_are_refused(model):
    other = TinyLlama(seed=8, max_position_embeddings=32)
    cache = other.forward(np.array([[1, 2]]), use_cache=True).cache
    snap = snapshot(cache)
    with pytest.raises(CacheMismatchError, match="different model"):
        model.forward(np.array([[5]]), cache=cache)
    assert_unchanged(cache, snap)
    with pytest.raises(InputError, match="KVCache"):
        model.forward(np.array([[5]]), cache=[(np.zeros(1), np.zeros(1))])


def test_bad_crop_leaves_the_cache(model):
    cache = model.forward(np.array([[1, 2, 3]]), use_cache=True).cache
    snap = snapshot(cache)
    for bad in (4, -4, 1.5, "2"):
        with pytest.raises(InputError):
            cache.crop(bad)
    assert_unchanged(cache, snap)


def test_bad_generation_arguments_leave_the_cache(model):
    cache = model.forward(np.array([[1, 2, 3]]), use_cache=True).cache
    snap = snapshot(cache)
    for kwargs in ({"temperature": -1}, {"top_p": 0.0}, {"top_k": -5}, {"max_new_tokens": -1},
                   {"max_new_tokens": 40}):
        kwargs = {"max_new_tokens": 3, **kwargs}
        with pytest.raises(InputError):
            generate(model, np.array([[4]]), cache=cache, **kwargs)
    assert_unchanged(cache, snap)
    with pytest.raises(InputError):
        model.new_cache(kv_dtype="int3")


@pytest.mark.parametrize("changes,message", [
    ({"num_attention_heads": 3}, "multiple of num_key_value_heads"),
    ({"head_dim": 7}, "even"),
    ({"num_hidden_layers": 0}, "positive int"),
    ({"architecture": "GPT2LMHeadModel"}, "not supported"),
])
def test_invalid_configs_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**changes)


def test_unknown_architecture_in_config_json_lists_supported():
    with pytest.raises(ConfigError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 10})


BASE_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(silu, gelu_pytorch_tanh\)"),
    ({"vocab_size": None}, "missing field\\(s\\) vocab_size"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 1}, "max_window_layers .* is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope scaling 'linear' needs a 'factor'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     "llama3 rope scaling needs 'high_freq_factor'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"sliding_window": -4, "architectures": ["MistralForCausalLM"]},
     "sliding_window must be a positive int"),
])
def test_unsupported_hf_configs_name_the_field(changes, message):
    raw = {k: v for k, v in {**BASE_HF, **changes}.items() if v is not None}
    with pytest.raises(ConfigError, match=f"^cfg.json: .*{message}"):
        ModelConfig.from_hf_dict(raw, source="cfg.json")


def test_config_files_that_are_not_configs(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**BASE_HF, "architectures": ["MistralForCausalLM"],
                                                      "sliding_window": 16}))
    config = ModelConfig.from_file(tmp_path)
    assert (config.sliding_window, config.head_dim, config.num_key_value_heads) == (16, 16, 4)


@given(st.lists(st.integers(-3, 40), max_size=30), st.integers(1, 40))
def test_the_one_range_check_finds_the_first_id_outside_the_vocabulary(ids, vocab):
    """validate.out_of_vocab, behind every refusal of a token id (model, engine, sessions, server): the first
    id outside [0, vocab) in order, with its index, as a plain loop finds it; also for a 2-D array."""
    from kvlab.validate import out_of_vocab

    first = next(((t, (i,)) for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    assert out_of_vocab(ids, vocab) == first
    if ids:
        grid = np.array([ids, ids[::-1]])
        found = out_of_vocab(grid, vocab)
        assert found == (None if first is None else (first[0], (0, first[1][0])))
    assert out_of_vocab([2**70, 1], 10) == (2**70, (0,))   # past int64: still named, not an overflow
