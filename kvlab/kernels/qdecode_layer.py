"""A decoder block over quantized weights for a few rows (a decode step) in two compiled calls.

The quantized twin of kernels/decode_layer.py (same two calls per layer, made by model/ops.py's
QuantizedOps for up to MAX_KERNEL_ROWS rows; attention in between is attention.py's, unchanged):

  * `qkv_rope`: RMSNorm, the q/k/v product from the tiles (+ bias), RoPE on the q and k heads, each row
    at its own position;
  * `output_mlp`: the output product and residual, RMSNorm, gate/up, SwiGLU, down and residual.

A matrix is passed as the tuple `kernel_args` makes: (codes, scales, offsets, tail codes, tail scales,
tail offsets, group), model/qtiles.py's layout. Each product's tiles go over the threads (qgemv's
`product_tile`, the tail on the last index); the group sums of x its offsets need are taken once per
product on the calling thread. Unfused, a quantized layer cost ~12 Python and dispatcher round trips
(norms, products, RoPE and SwiGLU in NumPy between them); here it is two. The arithmetic is the unfused
products' own (the same inline pieces), held to the NumPy reference through the model's tests.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvlab.kernels.decode_layer import bias_rope_rows
from kvlab.kernels.gemv import rms_norm_rows, silu_times_up
from kvlab.kernels.qgemv import group_sums_into, product_tile, tail_rows


@njit(cache=True, inline="always")
def _sums(x, w):
    """The group sums of x that w's offsets multiply ([B, G]; empty when w has no offsets)."""
    if w[2].shape[0] == 0:
        return np.zeros((0, 0), dtype=np.float32)
    group = w[6]
    xsum = np.empty((x.shape[0], x.shape[1] // group), dtype=np.float32)
    group_sums_into(x, group, xsum)
    return xsum


@njit(cache=True, inline="always")
def _tile_or_tail(x, xsum, w, out, t):
    """Tile t of w's product into out, or (t == number of tiles) its row-ordered tail."""
    tiles = w[0].shape[0]
    if t < tiles:
        product_tile(x, xsum, w[0], w[1], w[2], w[6], out, t)
    else:
        tail_rows(x, xsum, w[3], w[4], w[5], w[6], out, tiles * 8)


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def qkv_rope(x, norm, eps, w_qkv, bias, cos, sin, rotated_heads, out, zero):
    """out [B, (H_q + 2 H_kv) d] = rms_norm(x) @ w_qkv.T + bias, then RoPE on the first `rotated_heads`
    heads: cos[b], sin[b] [2, d/2] row b's rotation, sin sign-folded ([-sin, sin]) as the model's
    `rotate_halves`. An empty `bias` means none."""
    xn = np.empty_like(x)
    rms_norm_rows(x, norm, eps, xn, zero)
    xsum = _sums(xn, w_qkv)
    for t in prange(w_qkv[0].shape[0] + 1):
        _tile_or_tail(xn, xsum, w_qkv, out, t)
    bias_rope_rows(out, bias, cos, sin, rotated_heads)


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def output_mlp(x, attn, w_o, b_o, norm, eps, w_gate_up, w_down, zero):
    """x [B, hidden] += attn @ w_o.T + b_o (empty for none), then += the SwiGLU MLP of its RMSNorm, in
    place: the rest of a block after attention."""
    batch, hidden = x.shape
    projected = np.empty((batch, hidden), dtype=x.dtype)
    attn_sums = _sums(attn, w_o)
    for t in prange(w_o[0].shape[0] + 1):
        _tile_or_tail(attn, attn_sums, w_o, projected, t)
    for b in range(batch):
        for i in range(hidden):
            x[b, i] += projected[b, i] + (b_o[i] if b_o.shape[0] else zero)
    xn = np.empty_like(x)
    rms_norm_rows(x, norm, eps, xn, zero)
    inter = w_down[4].shape[1] * w_down[6]  # the down matrix's width
    gate_up = np.empty((batch, 2 * inter), dtype=x.dtype)
    xn_sums = _sums(xn, w_gate_up)
    for t in prange(w_gate_up[0].shape[0] + 1):
        _tile_or_tail(xn, xn_sums, w_gate_up, gate_up, t)
    act = np.empty((batch, inter), dtype=x.dtype)
    for b in range(batch):
        silu_times_up(gate_up[b], act[b], inter)
    down = np.empty((batch, hidden), dtype=x.dtype)
    act_sums = _sums(act, w_down)
    for t in prange(w_down[0].shape[0] + 1):
        _tile_or_tail(act, act_sums, w_down, down, t)
    for b in range(batch):
        for i in range(hidden):
            x[b, i] += down[b, i]
