"""Property tests: on random small configs, any chunk schedule, batch, fork or crop equals a full recompute."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlab import LlamaModel, ModelConfig

TOL = 1e-10


@st.composite
def configs(draw):
    kv_heads = draw(st.integers(1, 4))
    group = draw(st.sampled_from([1, 2, 3]))  # 1 = MHA, kv_heads == 1 = MQA, odd head counts via 3
    head_dim = draw(st.sampled_from([2, 4, 6, 8, 16, 32]))
    heads = kv_heads * group
    return ModelConfig(
        vocab_size=draw(st.integers(8, 300)),
        hidden_size=draw(st.sampled_from([8, 12, 16, 24])),
        intermediate_size=draw(st.integers(4, 48)),
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=draw(st.sampled_from([10000.0, 500.0, 1e6])),
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 8))),
        max_position_embeddings=64,
        architecture="MistralForCausalLM",
    )


def chunk_sizes(draw, total):
    sizes = []
    while total:
        size = draw(st.integers(1, total))
        sizes.append(size)
        total -= size
    return sizes


@given(config=configs(), data=st.data())
def test_any_chunk_schedule_equals_full_recompute(config, data):
    model = LlamaModel(config, dtype=np.float64, seed=data.draw(st.integers(0, 2**16)))
    batch = data.draw(st.integers(1, 3))
    length = data.draw(st.integers(1, config.max_position_embeddings))
    token = st.integers(0, config.vocab_size - 1)
    ids = np.array(data.draw(st.lists(st.lists(token, min_size=length, max_size=length), min_size=batch,
                                      max_size=batch)))
    full = model.forward(ids).logits
    cache, start, parts = None, 0, []
    for size in chunk_sizes(data.draw, length):
        out = model.forward(ids[:, start:start + size], cache=cache, use_cache=True)
        cache, start = out.cache, start + size
        parts.append(out.logits)
    assert np.abs(np.concatenate(parts, axis=1) - full).max() <= TOL
    assert cache.get_seq_length() == length
    assert all(k.shape == (batch, config.num_key_value_heads, length, config.head_dim) for k, _ in cache)


@given(config=configs(), data=st.data())
def test_fork_and_crop_sequences_equal_full_recompute(config, data):
    """Random edits (append, crop, fork-and-switch) on a cache track a token list; logits always match."""
    model = LlamaModel(config, dtype=np.float64, seed=1)
    token = st.integers(0, config.vocab_size - 1)
    tokens: list[int] = []
    cache = model.new_cache()
    for _ in range(data.draw(st.integers(1, 6))):
        action = data.draw(st.sampled_from(["append", "crop", "fork"])) if tokens else "append"
        if action == "crop":
            keep = data.draw(st.integers(0, len(tokens) - 1))
            cache.crop(keep)
            tokens = tokens[:keep]
        elif action == "fork":
            cache = cache.fork()
        room = config.max_position_embeddings - len(tokens)
        if room == 0:
            break
        new = data.draw(st.lists(token, min_size=1, max_size=min(room, 24)))
        got = model.forward(np.array([new]), cache=cache).logits
        tokens += new
        want = model.forward(np.array([tokens])).logits[:, -len(new):]
        assert np.abs(got - want).max() <= TOL
        assert cache.get_seq_length() == len(tokens)
        np.testing.assert_array_equal(cache.positions, np.arange(len(tokens)))
