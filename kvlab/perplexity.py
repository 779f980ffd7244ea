"""Perplexity over a token stream, with the windows the default model's card uses.

The stream s[0..N) is scored in blocks [i, i + stride). For the block ending at e the model reads
<bos> s[b] .. s[e-2] with b = max(0, e - context) and predicts s[b] .. s[e-1]; only s[i] .. s[e-1] count.
With stride == context the windows do not overlap and every token is scored once. This matches
scripts/eval_default_model.py (transformers), so the two numbers can be compared digit for digit.

Each window runs through a fresh KV cache of the chosen dtype, so a lossy cache's damage shows up here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from kvlab import validate
from kvlab.errors import InputError
from kvlab.model.llama import LlamaModel


@dataclass(frozen=True)
class PerplexityResult:
    tokens: int
    mean_nll: float  # nats per token

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def bits_per_token(self) -> float:
        return self.mean_nll / math.log(2)


def windows(num_tokens: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(b, i, e): read <bos> + s[b:e-1], predict s[b:e], score s[i:e]."""
    if not 0 < stride <= context:
        raise InputError(f"need 0 < stride <= context, got stride {stride}, context {context}")
    for i in range(0, num_tokens, stride):
        e = min(i + stride, num_tokens)
        yield max(0, e - context), i, e


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(model: LlamaModel, token_ids: Sequence[int], bos_token_id: int, context: int | None = None,
               stride: int | None = None, kv_dtype: object = None, chunk: int | None = None) -> PerplexityResult:
    """Mean NLL of `token_ids` under `model`; `chunk` feeds each window through the cache in pieces."""
    vocab = model.config.vocab_size
    ids = np.asarray(validate.token_ids(token_ids, "token_ids", vocab, allow_single=False, allow_empty=False),
                     dtype=np.int64)
    bos_token_id = validate.int_in_range(bos_token_id, "bos_token_id", 0, vocab - 1)
    for name, value in (("context", context), ("stride", stride), ("chunk", chunk)):
        validate.optional_int(value, name, 1)
    context = context or model.config.max_position_embeddings
    if context > model.config.max_position_embeddings:
        raise InputError(f"context {context} exceeds the model's {model.config.max_position_embeddings}")
    stride = stride or context
    total, count = 0.0, 0
    for b, i, e in windows(len(ids), context, stride):
        window = np.concatenate([[bos_token_id], ids[b:e - 1]])[None]
        cache = model.new_cache(kv_dtype=kv_dtype, capacity=window.shape[1])
        size = chunk or window.shape[1]
        logits = np.concatenate([model.forward(window[:, s:s + size], cache=cache).logits
                                 for s in range(0, window.shape[1], size)], axis=1)[0]
        logp = log_softmax(logits)
        targets = ids[b:e]
        nll = -logp[np.arange(len(targets)), targets]
        total += float(nll[i - b:].sum())
        count += e - i
    return PerplexityResult(tokens=count, mean_nll=total / count)
