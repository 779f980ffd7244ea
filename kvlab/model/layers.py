"""The decoder's building blocks as pure functions on NumPy arrays.

Each function is the formula from the paper with the layout transformers uses, so a reader can check one
against the other: RMSNorm, rotary position embeddings (the rotate-half convention), grouped-query
attention with a mask built from absolute positions, and the SwiGLU MLP.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvlab import validate
from kvlab.errors import InputError

# Up to this many query rows per KV head (group size x new tokens), attention computes K @ q^T.
SMALL_QUERY_ROWS = 16
# Longer runs of new positions are attended in blocks of this many (see `attend`).
QUERY_BLOCK = 128


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis.

    Written for few NumPy calls: a decode step runs this twice per layer on one row, right after a
    matrix-vector product has streamed megabytes through the caches, and there each call costs
    microseconds (np.mean alone is several). A single row takes its scale as a Python float.
    """
    n = x.shape[-1]
    if x.size == n:
        flat = x.reshape(n)
        out = x * (1.0 / math.sqrt(float(flat @ flat) / n + eps))
    else:
        mean_square = np.vecdot(x, x)[..., None]
        mean_square /= n
        mean_square += eps
        out = x / np.sqrt(mean_square)
    out *= weight
    return out


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: dict[str, Any] | None = None,
                  dtype: Any = np.float64) -> np.ndarray:
    """Per-pair rotation frequencies theta^(-2i/d), with HF's "linear" and "llama3" rescaling.

    Computed in `dtype` (float32 for float32 models, as transformers does) so angles round the same way.
    """
    dtype = np.dtype(dtype)
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(dtype) / dtype.type(head_dim)
    inv_freq = (1.0 / (dtype.type(theta) ** exponent)).astype(dtype)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / dtype.type(scaling["factor"])
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(dtype)
    elif kind != "default":
        raise ValueError(f"unsupported rope type {kind!r}")
    return inv_freq


def longrope_inv_freq(head_dim: int, theta: float, factors: Any, dtype: Any = np.float64) -> np.ndarray:
    """LongRoPE's frequencies 1 / (factor_i * theta^(2i/d)) for one factor list (short or long), as
    transformers computes them (the product in `dtype`, then the reciprocal)."""
    dtype = np.dtype(dtype)
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(dtype) / dtype.type(head_dim)
    return (1.0 / (np.asarray(factors, dtype=dtype) * dtype.type(theta) ** exponent)).astype(dtype)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables [..., T, d] for absolute `positions` [..., T]."""
    angles = np.asarray(positions)[..., None].astype(inv_freq.dtype) * inv_freq
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1] on the two halves of the last axis."""
    half = x.shape[-1] // 2
    signed_sin = np.concatenate([-sin[..., :half], sin[..., half:]], axis=-1)
    return rotate_halves(x, cos, signed_sin)


def rotate_halves(x: np.ndarray, cos: np.ndarray, signed_sin: np.ndarray) -> np.ndarray:
    """RoPE given cos and a sign-folded sin ([-sin, sin] on the two halves), both [..., d].

    Viewing the last axis as [2, d/2], rotate_half(x) * sin is the halves swapped (a reversed view, no
    copy) times signed_sin, so the rotation is two multiplies and an add. x1 cos + x2 (-sin) rounds
    exactly as x1 cos - x2 sin. The model precomputes signed_sin once per table, so a decode step does no
    concatenation.
    """
    shape = x.shape
    halves = x.reshape(*shape[:-1], 2, shape[-1] // 2)
    out = halves * cos.reshape(*cos.shape[:-1], 2, -1)
    out += halves[..., ::-1, :] * signed_sin.reshape(*signed_sin.shape[:-1], 2, -1)
    return out.reshape(shape)


def apply_rope(x: np.ndarray, positions: Any, theta: float = 10000.0,
               inv_freq: np.ndarray | None = None) -> np.ndarray:
    """Rotate x [B, H, T, d] (or [..., T, d]) by RoPE at absolute `positions` ([T], or [B, T] per row).

    Keys are rotated once, at the position where they are written; cached keys are never rotated again.
    """
    x = np.asarray(x)
    positions = np.asarray(positions)
    if x.ndim < 2 or x.dtype.kind != "f" or x.shape[-1] % 2:
        raise InputError(f"x must be a float array [..., tokens, head_dim] with an even head_dim, got "
                         f"{x.dtype} {list(x.shape)}")
    if positions.dtype.kind not in "iu" or positions.shape[-1:] != x.shape[-2:-1] or positions.ndim > 2 \
            or (positions.ndim == 2 and (x.ndim != 4 or positions.shape[0] != x.shape[0])):
        raise InputError(f"positions {positions.dtype} {list(positions.shape)} must be ints, one per token of "
                         f"x {list(x.shape)}: [T] or per-row [B, T]")
    if inv_freq is None:
        dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float64
        inv_freq = rope_inv_freq(x.shape[-1], theta, dtype=dtype)
    cos, sin = rope_cos_sin(positions, inv_freq)
    if positions.ndim == 2 and x.ndim == 4:
        cos, sin = cos[:, None], sin[:, None]  # per-row positions broadcast over heads
    return rotate(x, cos.astype(x.dtype, copy=False), sin.astype(x.dtype, copy=False))


def attention_mask(query_positions: np.ndarray, key_positions: np.ndarray, *, causal: bool = True,
                   sliding_window: int | None = None) -> np.ndarray | None:
    """Boolean [..., Tq, Tk] mask of allowed (query, key) pairs from absolute positions, or None if all are.

    Causal: key <= query. Sliding window W (Mistral): query - W < key. Never a local triangle: with a cache,
    query i sits at position num_cached_tokens + i.
    """
    q = np.asarray(query_positions)[..., :, None]
    k = np.asarray(key_positions)[..., None, :]
    if causal and sliding_window is None and k.max() <= q.min():
        return None  # a decode step with no window: every cached key is visible
    allowed = np.ones(np.broadcast_shapes(q.shape, k.shape), dtype=bool)
    if causal:
        allowed &= k <= q
    if sliding_window is not None:
        allowed &= k > q - sliding_window
    return allowed


def softmax(scores: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis; masked entries get probability 0 (a fully masked row gives zeros)."""
    return softmax_(np.array(scores, dtype=np.result_type(scores, np.float32)), mask)


def softmax_(scores: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """`softmax` computed in place in `scores` (which it returns).

    Attention scores are the largest arrays of a long prefill ([heads, T, T]); each pass over them costs
    more than the exp itself, so this makes the minimum: mask, max, subtract, exp, sum, divide, with no
    temporaries of that size. Fully masked rows (no visible key) come out as zeros, not NaN.
    """
    if mask is not None:
        np.copyto(scores, -np.inf, where=~mask)
    row_max = np.max(scores, axis=-1, keepdims=True)
    if mask is not None:
        row_max[~np.isfinite(row_max)] = 0.0
    scores -= row_max
    np.exp(scores, out=scores)
    total = np.add.reduce(scores, axis=-1, keepdims=True)
    if mask is not None:
        total[total == 0] = 1.0
    scores /= total
    return scores


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, query_positions: Any,
                      key_positions: Any, causal: bool = True, sliding_window: int | None = None,
                      scale: float | None = None) -> np.ndarray:
    """Scaled dot-product attention with compact KV heads (GQA/MQA/MHA).

    q: [B, H_q, T_new, d]; k, v: [B, H_kv, T_all, d]; positions: [T] or per-row [B, T].
    Query head h reads KV head h // (H_q / H_kv), the grouping transformers uses. K/V are never repeated:
    the G query heads of a group are stacked with their positions into one matmul against their KV head.
    Returns [B, H_q, T_new, d] for the new queries only. Inconsistent shapes raise InputError (a key
    without a position would otherwise be attended unmasked).
    """
    query_positions, key_positions = np.asarray(query_positions), np.asarray(key_positions)
    _check_attention_shapes(q, k, v, query_positions, key_positions, sliding_window)
    mask = attention_mask(np.asarray(query_positions), np.asarray(key_positions), causal=causal,
                          sliding_window=sliding_window)
    return attend(q, k, v, mask, scale)


def _check_attention_shapes(q: Any, k: Any, v: Any, query_positions: np.ndarray, key_positions: np.ndarray,
                            sliding_window: Any) -> None:
    """InputError unless q [B, H_q, Tq, d], k and v [B, H_kv, Tk, d] and the positions agree."""
    for name, array in (("q", q), ("k", k), ("v", v)):
        if not hasattr(array, "shape") or len(array.shape) != 4 or getattr(array, "dtype", None) is None \
                or array.dtype.kind != "f":
            raise InputError(f"{name} must be a 4-D float array [batch, heads, tokens, head_dim], got "
                             f"{getattr(array, 'shape', type(array).__name__)}")
    batch, heads, num_new, dim = q.shape
    if k.shape != v.shape:
        raise InputError(f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    if k.shape[0] != batch or k.shape[3] != dim:
        raise InputError(f"k/v {list(k.shape)} do not match q {list(q.shape)} in batch or head_dim")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise InputError(f"{heads} query heads cannot be grouped over {k.shape[1]} KV heads")
    for name, positions, length in (("query_positions", query_positions, num_new),
                                    ("key_positions", key_positions, k.shape[2])):
        if positions.dtype.kind not in "iu":
            raise InputError(f"{name} must be integers, got dtype {positions.dtype}")
        if positions.shape not in ((length,), (batch, length)):
            raise InputError(f"{name} has shape {list(positions.shape)}; expected [{length}] or "
                             f"[{batch}, {length}] (one position per {'query' if length == num_new else 'key'})")
    if sliding_window is not None:
        validate.int_in_range(sliding_window, "sliding_window", 1)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
           scale: float | None = None, logit_cap: float | None = None) -> np.ndarray:
    """grouped_attention with the mask already built ([Tq, Tk], per-row [B, Tq, Tk], or None = all visible).

    The model builds the mask once per forward (positions are the same in every layer) and calls this.
    Long query runs (prefill) go in blocks of QUERY_BLOCK positions, each against only the keys some query
    of the block can see: causal prefill then skips the masked half of both matmuls and of the softmax,
    and a block's scores stay in cache. Every query row's result is the same as in one big block.
    """
    batch, num_heads, num_new, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot be grouped over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    # Scaling q rather than the scores saves a pass over [T_new, T_all] (and is exact when d is 4^n).
    q5 = q.reshape(batch, num_kv_heads, group, num_new, head_dim) * q.dtype.type(scale)
    if num_new <= QUERY_BLOCK:
        return _attend_block(q5, k, v, mask, logit_cap).reshape(batch, num_heads, num_new, head_dim)
    out = np.empty(q5.shape, dtype=np.result_type(q5, v))
    for start in range(0, num_new, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, num_new)
        block_mask = None if mask is None else mask[..., start:stop, :]
        lo, hi = 0, k.shape[2]
        if block_mask is not None:
            visible = np.flatnonzero(block_mask.reshape(-1, block_mask.shape[-1]).any(axis=0))
            if visible.size == 0:  # no query of the block sees any key
                out[:, :, :, start:stop] = 0
                continue
            lo, hi = int(visible[0]), int(visible[-1]) + 1
            block_mask = block_mask[..., lo:hi]
        out[:, :, :, start:stop] = _attend_block(q5[:, :, :, start:stop], k[:, :, lo:hi], v[:, :, lo:hi],
                                                 block_mask, logit_cap)
    return out.reshape(batch, num_heads, num_new, head_dim)


def _attend_block(q5: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                  logit_cap: float | None = None) -> np.ndarray:
    """Scaled queries q5 [B, H_kv, G, n, d] against k, v [B, H_kv, Tk, d]; returns [B, H_kv, G, n, d].

    The softmax is left unnormalised until after the value matmul: dividing the [n, d] output instead of
    the [n, Tk] probabilities saves a pass over the scores. Masking touches only the key columns the
    mask cuts (for causal prefill, the block's own diagonal), not the whole score matrix.
    """
    batch, num_kv_heads, group, num_new, head_dim = q5.shape
    qg = q5.reshape(batch, num_kv_heads, group * num_new, head_dim)
    if group * num_new <= SMALL_QUERY_ROWS:
        # Decode: K @ q^T with a contiguous [d, G] right operand. OpenBLAS is slow at q @ K^T when q has
        # only a few rows (it packs all of K), ~3.5x slower at 1024 cached tokens; this orientation
        # streams K once. The small [T, G] result is then transposed back for the softmax.
        scores = np.swapaxes(k @ np.ascontiguousarray(np.swapaxes(qg, -1, -2)), -1, -2).copy()
    else:
        scores = qg @ np.swapaxes(k, -1, -2)  # [B, H_kv, G*n, Tk]
    shape = scores.shape
    scores = scores.reshape(batch, num_kv_heads, group, num_new, shape[-1])
    if logit_cap is not None:  # Gemma 2: scaled scores soft-capped before the mask and softmax
        softcap(scores, logit_cap)
    if mask is not None:
        cut = np.flatnonzero(~mask.all(axis=-2).reshape(-1, mask.shape[-1]).all(axis=0))
        if cut.size:
            lo, hi = int(cut[0]), int(cut[-1]) + 1
            part = mask[..., lo:hi]
            if part.ndim == 3:  # per-row positions: [B, n, Tk] -> [B, 1, 1, n, Tk]
                part = part[:, None, None]
            np.copyto(scores[..., lo:hi], -np.inf, where=~part)
            row_max = np.max(scores, axis=-1, keepdims=True)
            row_max[~np.isfinite(row_max)] = 0.0  # a row that sees no key gives zeros, not NaN
        else:
            mask = None
    if mask is None:
        row_max = np.max(scores, axis=-1, keepdims=True)
    scores -= row_max
    np.exp(scores, out=scores)
    total = np.add.reduce(scores, axis=-1, keepdims=True)
    total[total == 0] = 1.0
    out = scores.reshape(shape).astype(v.dtype, copy=False) @ v  # [B, H_kv, G*n, d]
    out = out.reshape(batch, num_kv_heads, group, num_new, head_dim)
    out /= total
    return out


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T for a weight matrix w [out, in] (HF's Linear layout), computed in x's dtype.

    A float16/bfloat16 matrix is widened first: the math stays in float32 whatever the weights are
    stored in (the compiled twin, kernels/gemv.py, widens element by element in registers instead).
    """
    return x @ w.astype(x.dtype, copy=False).T


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), as x / (1 + exp(-x)); exp overflow for very negative x correctly gives 0."""
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (torch's gelu(approximate="tanh"), Gemma's "gelu_pytorch_tanh"):
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    inner = x * x
    inner *= 0.044715
    inner += 1.0
    inner *= x
    inner *= math.sqrt(2.0 / math.pi)
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= x
    inner *= 0.5
    return inner


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GELU-tanh(gate) * up: Gemma's gated MLP activation."""
    out = gelu_tanh(gate)
    out *= up
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap), in place: Gemma 2's soft-capping of attention scores and logits."""
    x /= cap
    np.tanh(x, out=x)
    x *= cap
    return x


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up: the gated activation of the Llama MLP, in one temporary (same values as silu * up).

    Callers that may see very negative gates wrap it in np.errstate(over="ignore") (the model does, once
    per forward rather than once per layer: entering errstate costs microseconds).
    """
    out = np.negative(gate)
    np.exp(out, out=out)  # overflows to inf for gate < -88 (float32): silu is then -0, as it should be
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out
