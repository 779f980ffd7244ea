"""The layer loop's two seams (model/ops.py, model/attention.py) as the model uses them: each backend's Ops
and each Attention give the same logits as the NumPy reference, on the paths the other tests reach least."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab import Engine, SamplingParams, TinyLlama, generate
from kvlab.config import tiny_config
from kvlab.model.llama import LlamaModel
from kvlab.model.weights import random_weights
from kvlab.model.attention import ContiguousAttention, ObservedAttention


def test_an_observed_attention_refuses_one_that_reads_the_cache_in_place():
    model = TinyLlama(seed=1, backend="numba")
    in_place = ContiguousAttention(None, np.arange(3), 1, model.config, True, model.dtype)
    with pytest.raises(ValueError, match=r"^an observed attention must gather \(build it with compiled=False\)$"):
        ObservedAttention(in_place, lambda *args: None)


def biased_models():
    """The tiny config with attention biases (q/k/v and, as Llama's attention_bias has it, o_proj), on the
    compiled and the NumPy backend, the same random float64 weights (biases drawn, not zero)."""
    config = tiny_config(attention_bias=True)
    weights = random_weights(config, seed=3)
    rng = np.random.default_rng(4)
    for i in range(config.num_hidden_layers):
        weights[f"model.layers.{i}.self_attn.o_proj.bias"] = rng.standard_normal(config.hidden_size)
    return [LlamaModel(config, weights, dtype=np.float64, backend=b) for b in ("numba", "numpy")], weights


def test_biased_layers_give_the_reference_logits_on_the_compiled_paths():
    (compiled, reference), weights = biased_models()
    prompt = np.arange(40, 60)[None]  # 20 rows: the BLAS path; then single rows: the fused block kernels
    caches = [m.new_cache() for m in (compiled, reference)]
    steps = [prompt, [[7]], [[8]], [[9]]]
    for ids in steps:
        got, want = (m.forward(ids, cache=c).logits for m, c in zip((compiled, reference), caches))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    # the full recompute of every position agrees with the cached steps (the biases enter K and V too)
    full = reference.forward(np.concatenate([prompt[0], [7, 8, 9]])[None]).logits[0, -1]
    np.testing.assert_allclose(want[0, -1], full, rtol=0, atol=1e-10)
    # and the o_proj bias is in the sum: without it the logits move
    for name in [n for n in weights if n.endswith("o_proj.bias")]:
        weights[name] = np.zeros_like(weights[name])
    unbiased = LlamaModel(reference.config, weights, dtype=np.float64, backend="numpy")
    assert np.abs(unbiased.forward(prompt).logits - reference.forward(prompt).logits).max() > 1e-3


def test_biased_layers_in_the_engine_give_the_reference_tokens():
    (compiled, reference), _ = biased_models()
    prompts = [list(range(3, 25)), [5, 6, 7]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in Engine(m, block_size=4).generate(prompts, params)]
            for m in (compiled, reference)]
    want = [generate(reference, [p], 6)[0].tolist() for p in prompts]
    assert outs[0] == outs[1] == want
