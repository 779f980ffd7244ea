"""Matrix-vector and small-batch matrix products over float32, float16 and bfloat16 weights.

A decode step is a chain of products `x @ W.T` with x a few rows ([M, K], M = batch) and W a checkpoint
matrix [N, K] ([out, in], as stored): it is bound by reading W. These kernels read each row of W once
per step for each block of rows of x, widen half-precision elements in registers and accumulate in
float32 (float64 for a float64 model), with output columns split over the threads. Every row of x is
summed in one order whatever rows run beside it (kernels/fdot.py: rows four, two or one at a time, the
same lanes and the same final additions), so a decode step, a batch and a speculative verification give
a row the same bits up to MAX_KERNEL_ROWS rows. Below TILE_MIN_ROWS rows (memory-bound) a work item is
eight columns; from it (compute-bound) a block of columns sized for L2, over which each block of rows
of x passes.

Paired forms keep a decode step's chains in compiled code: RMSNorm before a product (`norm_linear`),
SwiGLU before the down projection (`swiglu_linear`). Larger M (prefill) goes to BLAS on a
float32 copy of W widened by a parallel kernel: there the work is compute, which BLAS does best.
The NumPy twins are `kvlab.model.layers.linear`, `rms_norm` and `swiglu`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from kvlab.kernels.bits import as_kernel_array, widen
from kvlab.kernels.compile_names import renamed
from kvlab.kernels.fastexp import fast_exp
from kvlab.kernels.fdot import row_dot_1, row_dot_2, row_dot_4

FASTMATH = {"reassoc", "contract"}  # vectorised sums; no assumptions about inf/nan (silu needs inf)
MAX_KERNEL_ROWS = 16  # above this many rows of x, BLAS on widened weights is faster
TILE_MIN_ROWS = 8  # from this many rows of x, work items are blocks of columns sized for L2 (`column_block`)
TILE_BLOCK_BYTES = 128 * 1024  # the rows of w one work item holds in L2 while x's row blocks pass over them
COLUMNS_PER_ITEM = 8  # below TILE_MIN_ROWS rows: output columns per parallel work item


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _one_row_at_a_time(x, w, out, zero, n0, n1):
    """out[:, n0:n1] for a float64 x (the seeds' models): every row of x alone against each row of w,
    through one compiled loop, so a row's sum never depends on the rows beside it."""
    rows, depth = x.shape
    for n in range(n0, n1):
        wn = w[n]
        for m in range(rows):
            xm = x[m]
            acc = zero
            for k in range(depth):
                acc += xm[k] * widen(wn[k])
            out[m, n] = acc


@njit(cache=True, inline="always")
def _row_blocks(x, w, out, n0, n1):
    """out[:, n0:n1] for a float32 x: rows of x four (then two, then one) at a time through fdot's kernels,
    which sum every row in one order; each block of x stays in L1 while w[n0:n1] passes over it."""
    rows = x.shape[0]
    m = 0
    while m + 4 <= rows:
        for n in range(n0, n1):
            row_dot_4(x, m, w, n, out)
        m += 4
    if m + 2 <= rows:
        for n in range(n0, n1):
            row_dot_2(x, m, w, n, out)
        m += 2
    if m < rows:
        for n in range(n0, n1):
            row_dot_1(x, m, w, n, out)


def _block(x, w, out, zero, n0, n1):  # pragma: no cover - numba compiles the overload below
    raise NotImplementedError


@overload(_block, inline="always")
def _block_impl(x, w, out, zero, n0, n1):
    if x.dtype == types.float32:
        def float32_rows(x, w, out, zero, n0, n1):
            _row_blocks(np.ascontiguousarray(x), w, out, n0, n1)
        return float32_rows
    return lambda x, w, out, zero, n0, n1: _one_row_at_a_time(x, w, out, zero, n0, n1)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def column_block(rows, columns, depth, itemsize):
    """Output columns per parallel work item. Below TILE_MIN_ROWS rows, eight (prange hands each thread an
    equal run of items anyway; eight columns make the call into `matvec_block` cost nothing). From it, an
    even count whose rows of w fit TILE_BLOCK_BYTES, so that w's block stays in L2 while each block of rows
    of x passes over it, and at most a 1/32 share of the columns, so that the threads' shares stay even."""
    if rows < TILE_MIN_ROWS:
        return COLUMNS_PER_ITEM
    fits = TILE_BLOCK_BYTES // max(depth * itemsize, 1)
    return max(2, min(fits, columns // 32) // 2 * 2)


@njit(fastmath=FASTMATH, cache=True)
def matvec_block(x, w, out, zero, n0, n1):
    """out[:, n0:n1] = x @ w[n0:n1].T, each row of x summed in one order whatever rows run beside it
    (kernels/fdot.py says why that needs LLVM vector code: a decode step, a batch and a speculative
    verification must give a row the same bits). out has unit stride along its rows.

    Called, not inlined: a fused layer runs three products, and inlining the product loops into each made
    numba's cold compile of one half-precision `output_mlp` take ~80 s; called, it compiles once per
    signature and every caller links it."""
    _block(x, w, out, zero, n0, n1)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def products(x, w, out, zero):
    """out = x @ w.T: blocks of output columns over the threads (inlined into each parallel caller, so
    that a fused block kernel stays one call)."""
    columns = w.shape[0]
    width = column_block(x.shape[0], columns, w.shape[1], w.itemsize)
    for block in prange((columns + width - 1) // width):
        matvec_block(x, w, out, zero, block * width, min(columns, (block + 1) * width))


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _matvec(x, w, out, zero):
    """out[m, n] = sum_k x[m, k] * w[n, k]."""
    products(x, w, out, zero)


@njit(fastmath=False, parallel=True, cache=True)
def _widen_matrix(w, out):
    for n in prange(w.shape[0]):
        for k in range(w.shape[1]):
            out[n, k] = widen(w[n, k])


@njit(fastmath=FASTMATH, cache=True, inline="always")
def rms_norm_rows(x, weight, eps, out, zero):
    """out = x / sqrt(mean(x^2) + eps) * weight, row by row (the sum of squares in x's dtype)."""
    rows, width = x.shape
    for m in range(rows):
        total = zero
        for k in range(width):
            total += x[m, k] * x[m, k]
        scale = 1.0 / np.sqrt(total / width + eps)
        for k in range(width):
            out[m, k] = x[m, k] * scale * weight[k]


def swiglu_rows(gate_up, out):
    """out = silu(gate) * up with gate, up the two halves of gate_up's last axis (as layers.swiglu),
    exp vectorised (fastexp.py). Two passes per row: exp(-gate) into out, then the rest. Written as one
    expression in one loop, LLVM did not vectorise it (2.9x slower, measured)."""
    inter = out.shape[1]
    for m in prange(out.shape[0]):
        silu_times_up(gate_up[m], out[m], inter)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def silu_times_up(gate_up, out, inter):
    """out[k] = silu(gate_up[k]) * gate_up[inter + k] for one row."""
    for k in range(inter):
        out[k] = fast_exp(-gate_up[k])
    for k in range(inter):
        out[k] = gate_up[k] / (1 + out[k]) * gate_up[inter + k]


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@njit(fastmath=False, cache=True)
def _geglu_rows(gate_up, out):
    """out = gelu_tanh(gate) * up (layers.geglu), element by element in float64: no vector code whose
    tail would treat an element by where it sits, so a row's result never depends on the rows beside it."""
    inter = out.shape[1]
    for m in range(out.shape[0]):
        for k in range(inter):
            g = np.float64(gate_up[m, k])
            inner = (g * g * 0.044715 + 1.0) * g * _SQRT_2_OVER_PI
            out[m, k] = (math.tanh(inner) + 1.0) * g * 0.5 * gate_up[m, inter + k]


def gated(gate_up: np.ndarray, gelu: bool) -> np.ndarray:
    """The gated MLP's activation over [..., 2 * inter] -> [..., inter]: SwiGLU (layers.swiglu) or, `gelu`,
    Gemma's GeGLU (layers.geglu), compiled row by row."""
    flat = np.ascontiguousarray(gate_up.reshape(-1, gate_up.shape[-1]))
    out = np.empty((flat.shape[0], flat.shape[1] // 2), dtype=flat.dtype)
    if gelu:
        _geglu_rows(flat, out)
    else:
        swiglu_batch(flat, out)
    return out.reshape(*gate_up.shape[:-1], out.shape[1])


# A prefill's or a batch's rows go over the threads; a decode step's one row stays on the calling thread
# (waking the other costs more than the row). error_model="numpy" (here and in the kernels whose loops
# divide: the per-head norms', attention's span combine): numba's default checks each float division for a zero
# divisor so as to raise ZeroDivisionError, and that branch kept LLVM from vectorising the loop
# (silu over 16 x 1536 values: 39 us, 15 us without it; the same bits, as no divisor here is zero).
_swiglu_parallel = njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")(swiglu_rows)
_swiglu_serial = njit(fastmath=FASTMATH, cache=True, inline="always", error_model="numpy")(
    renamed(swiglu_rows, "swiglu_rows_serial"))
SWIGLU_PARALLEL_ROWS = 4


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def swiglu_batch(gate_up, out):
    """out [M, inter] = swiglu of gate_up [M, 2 inter] row by row, over the threads from
    SWIGLU_PARALLEL_ROWS rows (each row's bits are the same either way)."""
    if gate_up.shape[0] >= SWIGLU_PARALLEL_ROWS:
        _swiglu_parallel(gate_up, out)
    else:
        _swiglu_serial(gate_up, out)


def widen_matrix(w: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A `dtype` copy of a weight matrix (parallel widening; float32 stays as is)."""
    if w.dtype == dtype:
        return w
    out = np.empty(w.shape, dtype=dtype)
    _widen_matrix(as_kernel_array(w), out)
    return out


def linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [..., K] @ w.T + bias with w [N, K] in any float dtype; the result has x's dtype."""
    flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
    if flat.shape[0] > MAX_KERNEL_ROWS:
        out = flat @ widen_matrix(w, x.dtype).T
    else:
        out = np.empty((flat.shape[0], w.shape[0]), dtype=x.dtype)
        _matvec(flat, as_kernel_array(w), out, x.dtype.type(0))
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], w.shape[0])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis (the twin of layers.rms_norm), one compiled pass."""
    flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
    out = np.empty_like(flat)
    rms_norm_rows(flat, weight, x.dtype.type(eps), out, x.dtype.type(0))
    return out.reshape(x.shape)


def norm_linear(x: np.ndarray, weight: np.ndarray, eps: float, w: np.ndarray,
                bias: np.ndarray | None = None) -> np.ndarray:
    """linear(rms_norm(x, weight, eps), w, bias): the projection that opens a block's attention or MLP."""
    return linear(rms_norm(x, weight, eps), w, bias)


def swiglu_linear(gate_up: np.ndarray, w: np.ndarray) -> np.ndarray:
    """linear(swiglu(gate, up), w) with gate, up the halves of gate_up: the MLP's down projection."""
    flat = np.ascontiguousarray(gate_up.reshape(-1, gate_up.shape[-1]))
    act = np.empty((flat.shape[0], flat.shape[1] // 2), dtype=flat.dtype)
    swiglu_batch(flat, act)
    return linear(act, w).reshape(*gate_up.shape[:-1], w.shape[0])
