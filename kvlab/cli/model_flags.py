"""Flags that choose how a loaded model computes, shared by every command that loads one."""

from __future__ import annotations

import argparse

from kvlab.model.act_quant import LOAD_CHOICES


def add_activations_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=LOAD_CHOICES, default="auto",
                   help="q8: round the inputs of quantized (GGUF block-type) matrices to int8 per group and take "
                        "integer dot products, as llama.cpp does: fast, lossy (kvlab fidelity --weights q4_0+q8 "
                        "measures it), verifiable (kvlab verify: cached == recompute bit for bit); float32: "
                        "exact products; auto (default): q8 for block-type weights, float32 otherwise")
