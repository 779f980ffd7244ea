"""Activations rounded to int8 per group: llama.cpp's Q8 activations, kvlab's opt-in `activations="q8"`.

llama.cpp multiplies quantized weights by activations rounded to 8 bits, so its CPU kernels can take
integer dot products (four or more products an instruction). That changes the logits (up to ~1.6 on a
Q8_0 file, measured; perplexity +0.0 % on Q8_0, +0.5 to +1.4 % on 4- and 5-bit types, `kvlab fidelity`),
and it is what makes a block-quantized file fast: 1.7x the exact products' decode and 4x their prefill
on a 1B-shaped Q4_0 file. So it is the default where it applies, as in llama.cpp: `kvlab.load(path)` of
a file with block-type matrices on the compiled backend computes in it ("auto", `default_activations`);
`activations="float32"` (`--activations float32`) gives the exact products, for fidelity work, and the
NumPy backend is always exact unless asked. It stays verifiable: a row's integer sums and float32 steps
do not depend on the rows beside it, and its attention runs through one kernel (the ops'
`batch_invariant`, model/attention.py), so `kvlab verify` finds cached == full recompute bit for bit.

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
AUTO = "auto"  # what a loader takes besides a mode: `default_activations` picks one for the loaded weights
LOAD_CHOICES = (AUTO, *ACTIVATIONS)
Q_MAX = np.float32(127)


def check_activations(name: object) -> str:
    """'float32' (exact products; None too) or 'q8'; InputError naming the choices otherwise."""
    if name is None:
        return "float32"
    if not isinstance(name, str) or name.lower() not in ACTIVATIONS:
        raise InputError(f"unknown activations {name!r}; choose from {', '.join(ACTIVATIONS)}")
    return name.lower()


def check_load_activations(name: object) -> str:
    """What `kvlab.load` and the CLI take: "auto" (None too) or a mode for check_activations."""
    if name is None or (isinstance(name, str) and name.lower() == AUTO):
        return AUTO
    return check_activations(name)


def default_activations(quantized: bool, backend: str, config: object = None) -> str:
    """"auto" resolved for a loaded model: int8 activations where it keeps block-quantized matrices and runs
    the compiled kernels (llama.cpp's arithmetic, and its speed); exact products otherwise: float and half
    weights have no integer kernels, the NumPy backend is the plain reference, and attention with soft-capped
    scores (Gemma 2) runs NumPy's reference, not the batch-invariant kernel, so the mode could not be
    verified there. `config`: the model's ModelConfig (None: not read yet, so not soft-capped as far as
    anyone knows)."""
    soft_capped = getattr(config, "attn_logit_softcapping", None) is not None
    return "q8" if quantized and backend == "numba" and not soft_capped else "float32"


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
