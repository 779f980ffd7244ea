"""Flags that choose how a loaded model computes, shared by every command that loads one."""

from __future__ import annotations

import argparse

from kvlab.model.act_quant import ACTIVATIONS


def add_activations_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", choices=ACTIVATIONS, default="float32",
                   help="q8: round the inputs of quantized (GGUF block-type) matrices to int8 per group and take "
                        "integer dot products, as llama.cpp does: faster, lossy (kvlab fidelity --weights "
                        "q4_0+q8 measures it); float32 (default): exact products")
