"""TinyLlama is a Llama: transformers' LlamaForCausalLM with the same weights gives the same logits (float64)."""

import numpy as np
import pytest

from kvlab import TinyLlama
from kvlab.model.weights import random_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("changes", [{}, {"num_key_value_heads": 1}, {"tie_word_embeddings": True}])
def test_tiny_llama_matches_transformers_in_float64(changes):
    model = TinyLlama(seed=7, **changes)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in model.config.to_hf_dict().items()
                                            if k not in ("architectures", "sliding_window")})
    reference = transformers.LlamaForCausalLM(hf_config).to(torch.float64).eval()
    weights = random_weights(model.config, seed=7)
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 17))
    with torch.no_grad():
        want = reference(torch.from_numpy(ids)).logits.numpy()
    got_full = model.forward(ids).logits
    cache = model.forward(ids[:, :9], use_cache=True).cache
    got_cached = model.forward(ids[:, 9:], cache=cache).logits
    # transformers rounds RMSNorm and the RoPE angles through float32 even in a float64 model, so the
    # reference agrees to ~1e-6, not 1e-10; a wrong convention (rotation, grouping, norm) errs by O(1).
    assert np.abs(got_full - want).max() < 1e-5
    assert np.abs(got_cached - want[:, 9:]).max() < 1e-5
    # kvlab's own cached path is exact against its own full recompute
    assert np.abs(got_cached - got_full[:, 9:]).max() < 1e-10
