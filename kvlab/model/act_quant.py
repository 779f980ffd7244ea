"""Activations rounded to int8 per group: llama.cpp's Q8 activations, kvlab's opt-in `activations="q8"`.

llama.cpp multiplies quantized weights by activations rounded to 8 bits, so its CPU kernels can take
integer dot products (four or more products an instruction). That changes the logits (up to ~1.6 on a
Q8_0 file, measured), so in kvlab it is a named mode, never the default: `kvlab.load(path,
activations="q8")`, its cost measured by `kvlab fidelity --activations q8`.

The rounding, the same on every path (decode kernels, prefill, the NumPy reference): before a product
with a quantized matrix, each row of x is cut into the matrix's groups (16 or 32 columns); a group with
largest magnitude a gets d = a / 127 and q = rint(x / d) in [-127, 127] (x times the float32 reciprocal
of d, as llama.cpp's vector code does; ties to even). The product is then `(q * d) @ dequantize(W).T`:
the integer kernels (kvlab/kernels/qdot.py) compute it with exact integer sums, prefill runs BLAS on
`q * d`. A group whose d underflows (values below ~1e-36) rounds to zero; a group holding a NaN or an
infinity gets d = NaN, so the non-finite value still reaches the output as NaN, as it would unrounded.
"""

from __future__ import annotations

import numpy as np

from kvlab.errors import InputError

ACTIVATIONS = ("float32", "q8")
Q_MAX = np.float32(127)


def check_activations(name: object) -> str:
    """'float32' (the default: exact products) or 'q8'; InputError naming the choices otherwise."""
    if name is None:
        return "float32"
    if not isinstance(name, str) or name.lower() not in ACTIVATIONS:
        raise InputError(f"unknown activations {name!r}; choose from {', '.join(ACTIVATIONS)}")
    return name.lower()


def round_activations(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (q [M, K] int8, d [M, K / group] float32) with q * d the rounded x."""
    rows, width = x.shape
    xg = np.asarray(x, dtype=np.float32).reshape(rows, width // group, group)
    finite = np.isfinite(xg).all(axis=-1)
    amax = np.abs(np.where(np.isfinite(xg), xg, 0)).max(axis=-1)
    d = (amax / Q_MAX).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    underflow = ~np.isfinite(inv)
    inv[underflow], d[underflow] = 0, 0
    inv[~finite] = 0
    d[~finite] = np.nan
    scaled = np.where(finite[..., None], xg, 0) * inv[..., None]
    q = np.clip(np.rint(scaled), -Q_MAX, Q_MAX).astype(np.int8)
    return q.reshape(rows, width), d


def rounded(x: np.ndarray, group: int) -> np.ndarray:
    """x as the integer kernels see it: q * d, float32, x's shape ([..., K])."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    q, d = round_activations(flat, group)
    out = q.reshape(flat.shape[0], -1, group).astype(np.float32) * d[..., None]
    return out.reshape(x.shape)
