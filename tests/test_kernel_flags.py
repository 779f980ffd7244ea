"""Every compiled kernel states its fast-math flags, so its bits do not depend on who compiled it first.

numba lets a callee that does not set `fastmath` inherit its caller's (`Flags.inherit_if_not_set`), and
keeps one compiled variant per signature, whoever asked first: `qgemv.dot_product` compiled first from
the fused layer (`qdecode_layer.qkv_rope`, reassoc + contract) fused a tail row's `total += scale * dot`
into an FMA, and the same matrix's product from Python then gave that row 1 ulp off the stacked one's (a
cold run of tests/test_quantized_kernels.py, 2026-12-08). Stated flags (False where bits are held equal
across paths) are not inherited. `inline="always"` bodies take their caller's flags by design.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from kvlab.kernels import AVAILABLE

needs_numba = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

# the kernels whose bits tests hold equal across paths (fused vs step by step, stacked vs alone, batch
# invariance): strict IEEE, whoever calls them
STRICT = {("kvlab.kernels.qgemv", "dot_product"), ("kvlab.kernels.qgemv", "round_rows"),
          ("kvlab.kernels.qgemv", "round_rows_into"), ("kvlab.kernels.qgemv", "_round_rows_parallel"),
          ("kvlab.kernels.qgemv", "_qmatmul"), ("kvlab.kernels.qgemv", "_dequantize_tiles_t"),
          ("kvlab.kernels.qdecode_layer", "_part"), ("kvlab.kernels.qdecode_layer", "_stack_product")}


def _dispatchers() -> dict[tuple[str, str], object]:
    from numba.core.registry import CPUDispatcher

    import kvlab.kernels

    found = {}
    for info in pkgutil.iter_modules(kvlab.kernels.__path__, "kvlab.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == info.name:
                found[(info.name, name)] = value
    return found


@needs_numba
def test_every_kernel_states_its_fast_math_flags():
    kernels = _dispatchers()
    assert STRICT <= set(kernels), STRICT - set(kernels)
    unstated = [key for key, kernel in kernels.items()
                if kernel.targetoptions.get("inline") != "always" and "fastmath" not in kernel.targetoptions]
    assert not unstated, f"kernels that would inherit a caller's fast-math flags: {unstated}"
    for key in STRICT:
        assert kernels[key].targetoptions["fastmath"] is False, key


@needs_numba
@pytest.mark.parametrize("flag", [False, {"reassoc", "contract"}])
def test_a_stated_flag_is_what_a_fast_math_caller_gets(flag):
    """The mechanism the test above relies on, on a toy: compiled first from a contracting caller, a
    callee that states its flag keeps it (no `contract` in its IR when it says False)."""
    import numpy as np
    from numba import njit

    @njit(fastmath=flag)
    def callee(a, b, c):
        return a + b * c

    @njit(fastmath={"contract"})
    def caller(a, b, c):
        return callee(a, b, c)

    caller(np.float32(1), np.float32(2), np.float32(3))
    assert ("contract" in callee.inspect_llvm(callee.signatures[0])) == bool(flag)
