"""A one-token step (decode) computes what a multi-token step and a full recompute compute.

The model has one layer loop, but attention takes different branches for one new query per sequence
(the compiled decode kernel, or `attend`'s K @ q^T orientation) and for more (the prefill kernel, the
blocked NumPy attention). Decoding token by token must agree with feeding the same tokens two at a time
(the multi-token branch) and with a full recompute, in float64 to 1e-10, for every shape: GQA / MQA /
MHA, q/k/v biases, a sliding window shorter than the context, batches, low-precision caches.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvlab import LlamaModel
from kvlab.config import ModelConfig

SHAPES = {
    "gqa": {},
    "mqa": {"num_key_value_heads": 1},
    "mha": {"num_key_value_heads": 4},
    "bias": {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
    "window": {"architecture": "MistralForCausalLM", "sliding_window": 5},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
}


def model_for(changes: dict, dtype=np.float64) -> LlamaModel:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    config = ModelConfig(**{**base, **changes})
    return LlamaModel(config, dtype=dtype, seed=3)


def decode_logits(model: LlamaModel, ids: np.ndarray, prefill: int, kv_dtype=None, step: int = 1) -> np.ndarray:
    """Logits of every position: a prefill of `prefill` tokens, then `step` tokens per forward."""
    cache = model.new_cache(ids.shape[0], kv_dtype=kv_dtype)
    out = [model.forward(ids[:, :prefill], cache=cache).logits]
    out += [model.forward(ids[:, i:i + step], cache=cache).logits for i in range(prefill, ids.shape[1], step)]
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 2])
def test_fast_decode_equals_general_path_and_full_recompute(name, batch):
    model = model_for(SHAPES[name])
    ids = np.random.default_rng(batch).integers(0, 97, size=(batch, 20))
    fast = decode_logits(model, ids, 6)
    general = decode_logits(model, ids, 6, step=2)
    full = model.forward(ids).logits
    assert np.abs(fast - general).max() <= 1e-10
    assert np.abs(fast - full).max() <= 1e-10


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_fast_decode_with_low_precision_cache(kv_dtype):
    model = model_for(SHAPES["window"], dtype=np.float32)
    ids = np.random.default_rng(0).integers(0, 97, size=(1, 16))
    fast = decode_logits(model, ids, 4, kv_dtype)
    general = decode_logits(model, ids, 4, kv_dtype, step=2)
    # both paths read the same rounded rows; measured max difference 6.0e-7 (float16) and 5.4e-7 (bfloat16)
    # on logits up to 3.6, i.e. float32 rounding. Bound 3e-6, 5x the measurement.
    assert np.abs(fast - general).max() <= 3e-6


def test_a_window_really_cuts_keys_in_the_fast_path():
    windowed = model_for(SHAPES["window"])
    unwindowed = LlamaModel(windowed.config.replace(sliding_window=None), dtype=np.float64, seed=3)
    ids = np.random.default_rng(5).integers(0, 97, size=(1, 12))
    a, b = decode_logits(windowed, ids, 2), decode_logits(unwindowed, ids, 2)
    assert np.abs(a[:, :5] - b[:, :5]).max() <= 1e-10 and np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3


def test_single_token_without_a_cache():
    model = model_for(SHAPES["bias"])
    ids = np.array([[7], [11]])
    fast = model.forward(ids).logits  # no cache: attention over the new rows only
    assert np.abs(fast - model.forward(ids, use_cache=True).logits).max() <= 1e-12
