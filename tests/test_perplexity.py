"""Perplexity against a naive per-token computation, and the lossy-cache knob it exposes."""

import math

import numpy as np
import pytest

from kvlab import InputError, TinyLlama
from kvlab.perplexity import perplexity, windows


def naive_nll(model, stream, bos, context, stride):
    total, count = 0.0, 0
    for b, i, e in windows(len(stream), context, stride):
        window = [bos] + list(stream[b:e - 1])
        for t in range(i, e):  # predict stream[t] from the window up to its position
            logits = model.forward(np.array([window[: t - b + 1]])).logits[0, -1]
            logits = logits - logits.max()
            total -= logits[stream[t]] - math.log(np.exp(logits).sum())
            count += 1
    return total / count, count


@pytest.mark.parametrize("context,stride", [(8, 8), (8, 3), (5, 5)])
def test_perplexity_matches_a_naive_loop(context, stride):
    model = TinyLlama(seed=7)
    stream = np.random.default_rng(1).integers(0, 256, size=19)
    result = perplexity(model, stream, bos_token_id=256, context=context, stride=stride)
    want, count = naive_nll(model, stream, 256, context, stride)
    assert result.tokens == count == 19
    assert abs(result.mean_nll - want) < 1e-10
    assert result.perplexity == pytest.approx(math.exp(want))


def test_windows_cover_every_token_once():
    for n, context, stride in [(10, 4, 4), (10, 4, 1), (3, 8, 8)]:
        scored = [t for _, i, e in windows(n, context, stride) for t in range(i, e)]
        assert scored == list(range(n))
        assert all(e - b <= context for b, _, e in windows(n, context, stride))


def test_chunked_and_lossy_caches():
    model = TinyLlama(seed=7)
    stream = np.random.default_rng(2).integers(0, 256, size=40)
    exact = perplexity(model, stream, 256, context=16)
    chunked = perplexity(model, stream, 256, context=16, chunk=5)
    lossy = perplexity(model, stream, 256, context=16, kv_dtype="float16", chunk=1)
    assert abs(chunked.mean_nll - exact.mean_nll) < 1e-10
    # a float16 cache moves the mean NLL by a measured 1.35e-5 here; bound ~4x that
    assert lossy.mean_nll != exact.mean_nll and abs(lossy.mean_nll - exact.mean_nll) < 5e-5


def test_bad_arguments():
    model = TinyLlama(seed=7)
    with pytest.raises(InputError):
        perplexity(model, [], 256)
    with pytest.raises(InputError, match="stride"):
        perplexity(model, [1, 2, 3], 256, context=4, stride=5)
