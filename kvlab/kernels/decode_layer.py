"""A decoder block for a few rows (a decode step) in three compiled calls.

At batch 1 a block is a chain of matrix-vector products with small steps between them (a norm, RoPE, a
cache write, attention over a few hundred keys, SwiGLU). Run as separate kernels and NumPy calls, those
steps cost ~20 Python and dispatcher round trips per layer, 600 per step; here they are three, made by
the model's one layer loop through its two seams (kvlab/model/ops.py's CompiledOps for up to
gemv.MAX_KERNEL_ROWS rows, kvlab/model/attention.py):

  * `qkv_rope`: RMSNorm, the fused q/k/v product (+ bias), the per-head q/k norms where the family has
    them (Qwen3, Gemma 3), RoPE on the q and k heads, each row at its own position (the engine's batched
    decodes sit at different positions);
  * (the attention writes k and v into the cache, which rounds them to its dtype as every path does;)
  * decode attention over the cache read in place (attention.py's kernel, called directly);
  * `output_mlp`: the output product and residual, RMSNorm, gate/up, SwiGLU, down and residual.

Measured against the unfused kernels on SmolLM2-135M's shape (2-core VM, median of 20 steps): bfloat16
weights 28 -> 22.5 ms at 128 context, 38 -> 27 ms at 1024; float32 50 -> 41 and 53 -> 45. Attention is
its own call so that the kernels compile per (compute dtype x weight dtype) and per (compute dtype x
cache dtype), not per product of the three.

Each product's output columns go over the threads (`gemv.products`); the steps between them run on
the calling thread. The arithmetic is the unfused kernels' own (same inline pieces, same order), which
tests/test_kernels.py holds to the NumPy reference through the model.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvlab.kernels.gemv import FASTMATH, products, rms_norm_rows, swiglu_batch


@njit(fastmath=FASTMATH, cache=True, inline="always")
def rms_norm_heads(heads, weight, eps, zero, width):
    """heads [H, d] = heads / sqrt(mean(heads^2) + eps) * weight, per head, in place: the reference's
    `layers.rms_norm` in its order and in the compute dtype (`width`, d as that dtype, keeps the mean
    from widening to float64). Measured on 24 heads of 128: 0.46 us, against 4.5 us for the
    block's `rms_norm_rows` on the same views (a float64 scale, and out aliasing x: not vectorised)."""
    for h in range(heads.shape[0]):
        head = heads[h]
        total = zero
        for i in range(head.shape[0]):
            total += head[i] * head[i]
        root = np.sqrt(total / width + eps)
        for i in range(head.shape[0]):
            head[i] = head[i] / root * weight[i]


@njit(fastmath=FASTMATH, cache=True, inline="always")
def bias_norm_rope_rows(out, bias, q_norm, k_norm, q_heads, eps, zero, cos, sin, rotated_heads):
    """out [B, heads * d] += bias (empty: none); then RMSNorm over each head of q (the first `q_heads`)
    with q_norm [d] and of k (the next rotated_heads - q_heads) with k_norm, when given (Qwen3, Gemma 3;
    empty: none); then RoPE on each row's first `rotated_heads` heads with that row's cos[b], sin[b]
    [2, d/2] (sin sign-folded, as the model's `rotate_halves`). The reference's order (ops.py's
    `stepwise_qkv_rope`). Shared by the float and the quantized fused step, whose products differ but
    whose epilogue is this."""
    half = cos.shape[2]
    heads = out.reshape(out.shape[0], out.shape[1] // (2 * half), 2 * half)
    width = np.empty(1, dtype=out.dtype)
    width[0] = 2 * half
    for b in range(out.shape[0]):
        row, c, s = out[b], cos[b], sin[b]
        if bias.shape[0]:
            for i in range(row.shape[0]):
                row[i] += bias[i]
        if q_norm.shape[0]:
            rms_norm_heads(heads[b, :q_heads], q_norm, eps, zero, width[0])
            rms_norm_heads(heads[b, q_heads:rotated_heads], k_norm, eps, zero, width[0])
        for h in range(rotated_heads):
            first, second = row[2 * h * half:(2 * h + 1) * half], row[(2 * h + 1) * half:(2 * h + 2) * half]
            for i in range(half):
                x1, x2 = first[i], second[i]
                first[i] = x1 * c[0, i] + x2 * s[0, i]
                second[i] = x2 * c[1, i] + x1 * s[1, i]


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")  # rms_norm_heads divides (gemv.py)
def qkv_rope(x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads, cos, sin, rotated_heads, out, zero):
    """out [B, (H_q + 2 H_kv) d] = rms_norm(x) @ w_qkv.T + bias, then the per-head q/k norms (q_norm,
    k_norm [d], empty for none), then RoPE on the first `rotated_heads` heads (q and k): cos[b], sin[b]
    [2, d/2] are row b's rotation (each row has its own position) with sin sign-folded ([-sin, sin]), as
    the model's `rotate_halves`. An empty `bias` means none."""
    xn = np.empty_like(x)
    rms_norm_rows(x, norm, eps, xn, zero)
    products(xn, w_qkv, out, zero)
    bias_norm_rope_rows(out, bias, q_norm, k_norm, q_heads, eps, zero, cos, sin, rotated_heads)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def output_mlp(x, attn, w_o, b_o, norm, eps, w_gate_up, w_down, zero):
    """x [B, hidden] += attn @ w_o.T + b_o (empty for none), then += the SwiGLU MLP of its RMSNorm: the
    rest of a block after attention, in place."""
    batch, hidden = x.shape
    projected = np.empty((batch, hidden), dtype=x.dtype)
    products(attn, w_o, projected, zero)
    for b in range(batch):
        for i in range(hidden):
            x[b, i] += projected[b, i] + (b_o[i] if b_o.shape[0] else zero)
    xn = np.empty_like(x)
    rms_norm_rows(x, norm, eps, xn, zero)
    inter = w_down.shape[1]
    gate_up = np.empty((batch, 2 * inter), dtype=x.dtype)
    products(xn, w_gate_up, gate_up, zero)
    act = np.empty((batch, inter), dtype=x.dtype)
    swiglu_batch(gate_up, act)
    down = np.empty((batch, hidden), dtype=x.dtype)
    products(act, w_down, down, zero)
    for b in range(batch):
        for i in range(hidden):
            x[b, i] += down[b, i]
