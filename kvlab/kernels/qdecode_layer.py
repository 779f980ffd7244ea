"""A decoder block over quantized weights for a few rows (a decode step) in two compiled calls.

The quantized twin of kernels/decode_layer.py (same two calls per layer, made by model/ops.py's
QuantizedOps for up to MAX_KERNEL_ROWS rows; attention in between is attention.py's, unchanged):

  * `qkv_rope`: RMSNorm, the q/k/v product from the tiles (+ bias), the per-head q/k norms where the
    family has them, RoPE on the q and k heads, each row at its own position;
  * `output_mlp`: the output product and residual, RMSNorm, gate/up, SwiGLU, down and residual.

A matrix is passed as the tuple `kernel_args` makes: (codes, scales, offsets, tail codes, tail scales,
tail offsets, group, factor, base scales, base offsets), model/qtiles.py's layout; q/k/v (gate/up) of
different types as a tuple of two or three such tuples, each its own product into its columns
(`_stack_product`). With a matrix in the integer dot-product layout (`qgemv.dot_kernel_args`, one field
longer) the same two calls round each product's input to int8 and take integer dot products (the model's
`activations="q8"`, kernels/qdot.py): the tuple's length picks the kernel when numba compiles, one
specialisation per layout. Each product is one parallel call, its tiles over the
threads (qgemv's `product_tile` / `dot_tile`, the tail on the last index); the group sums of x its offsets
need (or the int8 rounding of x) are taken once per product on the calling thread. Unfused, a quantized
layer cost ~12 Python and dispatcher round trips (norms, products, RoPE and SwiGLU in NumPy between them);
here it is two. The arithmetic is the unfused products' own (the same inline pieces), held to the NumPy
reference through the model's tests.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvlab.kernels.decode_layer import bias_norm_rope_rows
from kvlab.kernels.gemv import rms_norm_rows, swiglu_batch
from kvlab.kernels.qgemv import dot_product, group_sums_into, product_tile, tail_rows


# A matrix comes as the tuple `qgemv.kernel_args` makes (10 fields: the float layout, exact products) or
# `qgemv.dot_kernel_args` (11: the integer layout, `activations="q8"`), a stack of matrices whose types differ
# as a tuple of 2 or 3 of those. numba folds `len` of a tuple argument to a constant and prunes the other
# branches before typing, so `if len(w) == 11 / 10 / else` picks the kernel when a variant compiles, with no
# call level between a layer and its products (each level is one more pass over their code when numba
# compiles a variant, decode_block.py's `_block`; an `overload` was one, 32 compiles of its lambda in a cold
# suite, never cached to disk). The branch is written out where a product is called (`qkv_rope`,
# `output_mlp`, `_part`, `_product`): moved into an inlined helper, `w` would no longer be an argument and
# its length would not fold.
@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def _float_product(x, w, out):
    """out = x @ W.T over the float layout (exact products): x read as it is, the group sums its offsets
    multiply taken once; tiles over the threads, the tail on the last index."""
    xsum = np.zeros((0, 0), dtype=np.float32)
    if w[2].shape[0] != 0 or w[5].shape[0] != 0:
        xsum = np.empty((x.shape[0], x.shape[1] // w[6]), dtype=np.float32)
        group_sums_into(x, w[6], xsum)
    tile_sum = xsum
    if w[7] != np.float32(1) and w[2].shape[0] != 0:  # offsets folded into the scales (qgemv.kernel_args)
        tile_sum = xsum * w[7]
    tiles = w[0].shape[0]
    for t in prange(tiles + 1):
        if t < tiles:
            product_tile(x, tile_sum, w[0], w[1], w[2], w[8], w[9], w[6], out, t)
        else:
            tail_rows(x, xsum, w[3], w[4], w[5], w[6], out, tiles * 8)


@njit(fastmath=False, cache=True)
def _part(x, w, out, start):
    """Columns start.. of out = x @ w.T for one matrix w of a stack; returns the column after them."""
    rows = w[0].shape[0] * 8 + w[4].shape[0]
    part = np.empty((x.shape[0], rows), dtype=out.dtype)
    if len(w) == 11:  # the integer layout (see above)
        dot_product(x, w, part)
    else:
        _float_product(x, w, part)
    out[:, start:start + rows] = part
    return start + rows


@njit(fastmath=False, cache=True)
def _stack_product(x, w, out):
    """out = x @ W.T for matrices stacked by rows whose types differ (a tuple of 2 or 3: a Q4_K_M file's Q4_K
    q/k beside its Q6_K v), each part its own product into its columns, exactly as it would run alone (its
    own rounding of x to int8: with int8 activations a row gets the bits the step-by-step RowStack gives
    it). The first part starts at an int64 0, not a literal 0: a literal is a variant of `_part` of its own,
    so a type first in one stack and later in another (Q4_1 in a Q4_1/Q8_0/Q4_1 stack) compiled twice."""
    if len(w) == 2:
        _part(x, w[1], out, _part(x, w[0], out, np.int64(0)))
    else:
        _part(x, w[2], out, _part(x, w[1], out, _part(x, w[0], out, np.int64(0))))


@njit(fastmath=False, cache=True)
def _product(x, w, out):
    """out = x @ W.T for one matrix or a stack (see above), from Python (the tests); the layer kernels
    branch the same way themselves."""
    if len(w) == 11:
        dot_product(x, w, out)
    elif len(w) == 10:
        _float_product(x, w, out)
    else:
        _stack_product(x, w, out)


@njit(fastmath={"reassoc", "contract"}, cache=True, error_model="numpy")  # rms_norm_heads divides (gemv.py)
def qkv_rope(x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads, cos, sin, rotated_heads, out, zero):
    """out [B, (H_q + 2 H_kv) d] = rms_norm(x) @ w_qkv.T + bias (w_qkv one matrix or a stack, see above),
    then the per-head q/k norms (q_norm, k_norm [d], empty for none), then RoPE on the first `rotated_heads`
    heads: cos[b], sin[b] [2, d/2] row b's rotation, sin sign-folded ([-sin, sin]) as the model's
    `rotate_halves`. An empty `bias` means none."""
    xn = np.empty_like(x)
    rms_norm_rows(x, norm, eps, xn, zero)
    if len(w_qkv) == 11:  # the layout picks the kernel (see above)
        dot_product(xn, w_qkv, out)
    elif len(w_qkv) == 10:
        _float_product(xn, w_qkv, out)
    else:
        _stack_product(xn, w_qkv, out)
    bias_norm_rope_rows(out, bias, q_norm, k_norm, q_heads, eps, zero, cos, sin, rotated_heads)


@njit(fastmath={"reassoc", "contract"}, cache=True)
def output_mlp(x, attn, w_o, b_o, norm, eps, w_gate_up, w_down, zero):
    """x [B, hidden] += attn @ w_o.T + b_o (empty for none), then += the SwiGLU MLP of its RMSNorm, in
    place: the rest of a block after attention."""
    batch, hidden = x.shape
    projected = np.empty((batch, hidden), dtype=x.dtype)
    if len(w_o) == 11:  # the layout picks the kernel (see above), here and for gate/up and down
        dot_product(attn, w_o, projected)
    elif len(w_o) == 10:
        _float_product(attn, w_o, projected)
    else:
        _stack_product(attn, w_o, projected)
    for b in range(batch):
        for i in range(hidden):
            x[b, i] += projected[b, i] + (b_o[i] if b_o.shape[0] else zero)
    xn = np.empty_like(x)
    rms_norm_rows(x, norm, eps, xn, zero)
    inter = w_down[4].shape[1] * w_down[6]  # the down matrix's width
    gate_up = np.empty((batch, 2 * inter), dtype=x.dtype)
    if len(w_gate_up) == 11:
        dot_product(xn, w_gate_up, gate_up)
    elif len(w_gate_up) == 10:
        _float_product(xn, w_gate_up, gate_up)
    else:
        _stack_product(xn, w_gate_up, gate_up)
    act = np.empty((batch, inter), dtype=x.dtype)
    swiglu_batch(gate_up, act)
    down = np.empty((batch, hidden), dtype=x.dtype)
    if len(w_down) == 11:
        dot_product(act, w_down, down)
    elif len(w_down) == 10:
        _float_product(act, w_down, down)
    else:
        _stack_product(act, w_down, down)
    for b in range(batch):
        for i in range(hidden):
            x[b, i] += down[b, i]
