"""Independent references the tests compare kvlab against: short, obvious, and sharing no code with kvlab."""

from __future__ import annotations

import math

import numpy as np


def common_prefix_reference(cached, tokens) -> int:
    """Walk both sequences until the first position where they differ."""
    n = 0
    for a, b in zip(list(cached), list(tokens)):
        if int(a) != int(b):
            break
        n += 1
    return n


def attention_reference(q, k, v, qpos, kpos, window=None, causal=True):
    """Per-head attention in plain NumPy: one query head at a time, its KV head chosen as h // group.

    q [B, H, Tq, d], k/v [B, H_kv, Tk, d], positions [Tq] / [Tk] or per row [B, Tq] / [B, Tk]. Each head
    is a textbook softmax(q k^T / sqrt(d)) v over the keys its mask allows; a row that sees no key gives
    zeros. No blocking, no grouping tricks, no in-place softmax: the opposite of kvlab's `attend`.
    """
    batch, heads, tq, d = q.shape
    group = heads // k.shape[1]
    qpos = np.broadcast_to(np.asarray(qpos), (batch, tq))
    kpos = np.broadcast_to(np.asarray(kpos), (batch, k.shape[2]))
    out = np.zeros(q.shape, dtype=np.float64)
    for b in range(batch):
        allowed = np.ones((tq, k.shape[2]), dtype=bool)
        if causal:
            allowed &= kpos[b][None, :] <= qpos[b][:, None]
        if window is not None:
            allowed &= kpos[b][None, :] > qpos[b][:, None] - window
        for h in range(heads):
            scores = q[b, h].astype(np.float64) @ k[b, h // group].astype(np.float64).T / math.sqrt(d)
            scores = np.where(allowed, scores, -np.inf)
            top = scores.max(axis=-1, keepdims=True)
            top[~np.isfinite(top)] = 0.0
            w = np.exp(scores - top)
            total = w.sum(axis=-1, keepdims=True)
            total[total == 0] = 1.0
            out[b, h] = (w / total) @ v[b, h // group].astype(np.float64)
    return out
