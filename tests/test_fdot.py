"""The float products give a row of x the same bits whatever rows run beside it (kernels/fdot.py).

Before, LLVM chose the summation order of the float products per block of rows: on an AVX2 CPU (Zen 3) the
rows of a four-row block came out 1e-7 apart from the same rows alone, and a speculative verification's
rows from the one-token steps they must equal (tests/test_speculative.py failed there, not on AVX-512).
These tests hold every row count up to MAX_KERNEL_ROWS to the one-row bits, on every weight dtype, for
depths that are and are not a multiple of the eight-lane chunks, against a float64 reference besides.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.kernels import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

if AVAILABLE:
    from kvlab.kernels import gemv
    from kvlab.kernels.bits import BFLOAT16, as_kernel_array

WEIGHTS = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16"}


def weights(rng: np.random.Generator, shape: tuple[int, int], name: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(BFLOAT16 if name == "bfloat16" else WEIGHTS[name])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 16), out=st.integers(1, 70), depth=st.integers(1, 300),
       weight=st.sampled_from(list(WEIGHTS)), compute=st.sampled_from(["float32", "float64"]),
       seed=st.integers(0, 2**16))
def test_each_row_of_a_product_has_the_bits_it_has_alone(rows, out, depth, weight, compute, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, depth)) * rng.uniform(0.1, 10)).astype(compute)
    w = weights(rng, (out, depth), weight)
    together = np.empty((rows, out), dtype=compute)
    gemv._matvec(x, as_kernel_array(w), together, x.dtype.type(0))
    for m in range(rows):
        alone = np.empty((1, out), dtype=compute)
        gemv._matvec(x[m:m + 1], as_kernel_array(w), alone, x.dtype.type(0))
        assert np.array_equal(together[m], alone[0]), f"row {m} of {rows} differs from the row alone"
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    # float32: each product rounded once, sums in float32 over `depth` terms. Measured (400 draws of these
    # strategies through gemv._matvec, scratch script, 2026-12-06): worst |error| / max sum|x w| 6.3e-8 in
    # float32, 4.8e-16 in float64; the bounds below are 60x and 200x that
    bound = (4e-6 if compute == "float32" else 1e-13) * (np.abs(x.astype(np.float64)) @ np.abs(
        w.astype(np.float64)).T).max() + 1e-30
    assert np.abs(together - exact).max() <= bound


def test_a_rows_sum_is_the_documented_order():
    """fdot's order written out in NumPy: chunk j of eight columns into accumulator j % CHAINS by a fused
    multiply-add (float64 products rounded once to float32 equal an FMA's for float32 inputs: a product of
    two float32 is exact in float64), the last partial chunk zero-filled, the accumulators added in order,
    then the lanes as ((0+4)+(2+6))+((1+5)+(3+7)). Equal bits, for a depth with a partial chunk and one
    full chunk left over past the chains."""
    from kvlab.kernels.fdot import CHAINS, LANES
    rng = np.random.default_rng(5)
    depth = LANES * (2 * CHAINS + 1) + 3
    x = rng.standard_normal((3, depth)).astype(np.float32)
    w = rng.standard_normal((2, depth)).astype(np.float32)
    got = np.empty((3, 2), dtype=np.float32)
    gemv._matvec(x, w, got, np.float32(0))
    padded = -(-depth // LANES) * LANES
    for m in range(3):
        for n in range(2):
            xp = np.zeros(padded, np.float32)
            wp = np.zeros(padded, np.float32)
            xp[:depth], wp[:depth] = x[m], w[n]
            acc = np.zeros((CHAINS, LANES), np.float32)
            for j in range(padded // LANES):
                lanes = slice(j * LANES, (j + 1) * LANES)
                exact = xp[lanes].astype(np.float64) * wp[lanes] + acc[j % CHAINS]
                acc[j % CHAINS] = exact.astype(np.float32)  # one rounding: the FMA's
            total = acc[0]
            for a in acc[1:]:
                total = total + a
            four = total[:4] + total[4:]
            two = four[:2] + four[2:]
            assert got[m, n] == np.float32(two[0] + two[1])


def test_the_row_kernels_are_vector_fmas():
    """The compiled block holds vector FMAs on ymm registers (the chunks), and its half-precision variant
    widens with vcvtph2ps where the CPU has F16C."""
    from numba import njit

    from kvlab.kernels.fdot import row_dot_4

    @njit
    def four_rows(x, w, out):
        row_dot_4(x, 0, w, 0, out)

    x = np.ones((4, 64), np.float32)
    out = np.empty((4, 1), np.float32)
    for w in (np.ones((1, 64), np.float32), as_kernel_array(np.ones((1, 64), np.float16))):
        four_rows(x, w, out)
        assert np.array_equal(out[:, 0], np.full(4, 64, np.float32))
    asm = "\n".join(four_rows.inspect_asm().values())
    assert len(re.findall(r"vfmadd\d+ps\s+[^\n]*ymm", asm)) >= 8
    import llvmlite.binding as llvm
    if "+f16c" in llvm.get_host_cpu_features().flatten().split(","):
        assert "vcvtph2ps" in asm
