"""A decoder block of a decode step in one compiled call: no Python, and no sleeping worker, between a
layer's products.

Unfused, the layer loop (model/llama.py `run_layers`) makes three calls a layer: `qkv_rope` (kernels/
decode_layer.py, or qdecode_layer.py over quantized weights), attention (model/attention.py: the K/V
write, the queries' scaling, kernels/attention.py's decode kernel) and `output_mlp`. Between them sit a
few dozen microseconds of Python (attention's write, scaling and operand checks, the dispatchers' typing
of a dozen arguments), long enough for numba's second thread to stop spinning and fall asleep, so the
next product pays its wake-up (kernels/__init__.py). `decode_block` is the same three steps in one call:
the same kernels, in the same order, with the same arithmetic (the K/V rows copied, the queries
multiplied by the scale, the parallel decode kernel), so every row gets the bits the three calls give
it (tests/test_decode_block.py holds them equal, bit for bit).

It applies where all three steps read in place with no Python of their own: a layer whose both halves fuse
in a float32 model (model/ops.py `block_fuses`; a float64 model, the exact reference, takes the three
calls and skips this kernel's cold compile), over a cache the kernels write where it lies (float rows of
the compute dtype in a block pool or a contiguous cache, one block per sequence there; int8 / int4 / fp8
codes in a block pool, quantized by the pool's own compiled writer), in a step whose every row goes
through the decode kernel (model/attention.py `fused_step`): a decode step (one query per sequence), and
in the engine with batch-invariant attention (int8 activations, the default for block-quantized files) any
step, speculative verification rows and prefill chunks included, each row a one-query "sequence" with its
own key range. Other steps (exact-mode prefill chunks, float16 / bfloat16 caches, whose writes round, a
contiguous cache of codes) take the three calls. The weights' kind picks the entry: `decode_block` over
float matrices (decode_layer's kernels, model/ops.py's CompiledOps), `qdecode_block` over quantized ones
(kernel_args tuples, qdecode_layer's, QuantizedOps); the pool's kind picks the attention when numba compiles.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from kvlab.kernels import decode_layer, qdecode_layer
from kvlab.kernels.attention import write_and_attend, write_codes_and_attend


def _attend(qkv, heads, attention, out, zero):
    """attention.write_and_attend over a float pool's operands (a tuple of 10), write_codes_and_attend over
    a pool of codes' (a tuple of 16)."""


@overload(_attend)
def _attend_impl(qkv, heads, attention, out, zero):
    if len(attention) == 10:
        return lambda qkv, heads, attention, out, zero: write_and_attend(
            qkv, heads, attention[0], attention[1], attention[2], attention[3], attention[4], attention[5],
            attention[6], attention[7], attention[8], attention[9], out, zero)
    return lambda qkv, heads, attention, out, zero: write_codes_and_attend(
        qkv, heads, attention[0], attention[1], attention[2], attention[3], attention[4], attention[5],
        attention[6], attention[7], attention[8], attention[9], attention[10], attention[11], attention[12],
        attention[13], attention[14], attention[15], out, zero)


@njit(inline="always")
def _block(qkv_rope, output_mlp, x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads, cos, sin, rotated_heads, zero,
           attention, w_o, b_o, post_norm, w_gate_up, w_down):
    """The block's three steps with the layer kernels `qkv_rope` and `output_mlp` (decode_layer's or
    qdecode_layer's), inlined into each entry below: numba links a called kernel's code into its caller and
    optimises and compiles the whole again, so each level of calls between the block and its products is
    one more pass over all of them when a variant compiles. The weights' kind picked by an `overload` was
    such a level (with qdecode_layer's `_stacked` before `_product`: the cold compiles of
    tests/test_decode_block.py and test_families_gguf's quantized files took 401 s instead of 441; the
    `_product` overload after it made a qwen3 Q8_0 / Q4_0 file's variant 20 / 23 s, 17 / 21 s without:
    qdecode_layer.py branches on the tuple's length)."""
    seqs, d = x.shape[0], 2 * cos.shape[2]
    qkv = np.empty((seqs, (rotated_heads + attention[0].shape[1]) * d), dtype=x.dtype)
    qkv_rope(x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads, cos, sin, rotated_heads, qkv, zero)
    attn = np.empty((seqs, q_heads, d), dtype=x.dtype)
    _attend(qkv, q_heads, attention, attn, zero)
    output_mlp(x, attn.reshape(seqs, q_heads * d), w_o, b_o, post_norm, eps, w_gate_up, w_down, zero)


@njit(fastmath=False, cache=True)
def decode_block(x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads, cos, sin, rotated_heads, zero, attention, w_o,
                 b_o, post_norm, w_gate_up, w_down):
    """x [S, hidden] through one block of float matrices, in place: `qkv_rope` (its arguments as there, its
    output a buffer made here), attention.write_and_attend over `attention` (the tuple model/attention.py's
    `fused_step` gives: k_blocks, v_blocks, slot_blocks, slot_rows, tables, starts, ends, span, threads,
    scale; over codes, write_codes_and_attend's operands), then `output_mlp` with the post-attention norm
    `post_norm`."""
    _block(decode_layer.qkv_rope, decode_layer.output_mlp, x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads,
           cos, sin, rotated_heads, zero, attention, w_o, b_o, post_norm, w_gate_up, w_down)


@njit(fastmath=False, cache=True)
def qdecode_block(x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads, cos, sin, rotated_heads, zero, attention,
                  w_o, b_o, post_norm, w_gate_up, w_down):
    """`decode_block` over quantized matrices (kernel_args tuples, or stacks of them: qdecode_layer.py)."""
    _block(qdecode_layer.qkv_rope, qdecode_layer.output_mlp, x, norm, eps, w_qkv, bias, q_norm, k_norm, q_heads,
           cos, sin, rotated_heads, zero, attention, w_o, b_o, post_norm, w_gate_up, w_down)
