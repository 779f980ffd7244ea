"""`kvlab verify`: cached vs full-recompute logits over several schedules; non-zero exit on any mismatch."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from rich.table import Table

from kvlab.cli.fmt import console
from kvlab.cli.model_flags import add_activations_flag
from kvlab.cli.sampling_flags import add_grammar_flags, compiled_grammar, grammar_spec
from kvlab.errors import InputError
from kvlab.loader import DEFAULT_COMPUTE_DTYPE
from kvlab.model.llama import LlamaModel, TinyLlama
from kvlab.tokenizer import ByteTokenizer
from kvlab import validate
from kvlab.verify import default_tolerance, fixed_tolerance, verify_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove cached logits equal a full recompute",
                       description="Compare cached and full-prefix logits over several schedules.")
    p.add_argument("-m", "--model", metavar="PATH", default=None,
                   help="verify an HF model folder or a .gguf file instead ('default' = the shipped model)")
    p.add_argument("--seed", type=int, default=7, help="TinyLlama weight seed (default 7, the seeds' model)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="fixed max abs error allowed (default: scaled to the dtype, the depth and the logits: "
                        "(max|logit| + 1) x 8 x layers x eps)")
    p.add_argument("--length", type=int, default=24, help="tokens per checked sequence (default 24)")
    p.add_argument("--bidirectional", action="store_true",
                   help="negative control: a non-causal model, for which the check must fail")
    p.add_argument("--dtype", choices=["float64", "float32"], default=None,
                   help="compute dtype. Default for --model: float32 with the weights as stored, what generate, "
                        "chat and serve run; float64 is the deeper check of the model itself (weights dequantized "
                        "or cast to float64, ~4x the time and memory). Default for the seeds' tiny model: float64")
    p.add_argument("--backend", choices=["auto", "numba", "numpy"], default="auto",
                   help="compiled kernels (numba, the default where available) or the NumPy reference")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    add_activations_flag(p)
    add_grammar_flags(p)  # with a grammar on: constrained greedy tokens and masked logits in every schedule
    p.set_defaults(run=run)


def weight_formats(model: LlamaModel) -> list[str]:
    """How the model holds its matrices: GGUF block types ("Q4_0") and NumPy dtypes ("float32"), sorted."""
    matrices = [model.embed, model.lm_head]
    for layer in model.layers:
        matrices += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
    formats: set[str] = set()
    while matrices:
        m = matrices.pop()
        if hasattr(m, "parts"):  # a RowStack of differently typed matrices
            matrices += m.parts
        elif hasattr(m, "type_name"):
            formats.add(m.type_name)
        elif getattr(m, "ndim", 0) == 2:
            formats.add(np.dtype(m.dtype).name)
    return sorted(formats)


def verified_path(model: LlamaModel, loaded: bool) -> dict:
    """Which computation the verdict is about: compute dtype, weights as the model holds them (as generate,
    chat and serve hold them, or converted for the float64 reference) and compiled kernels or NumPy."""
    formats = weight_formats(model)
    runs = not loaded or model.dtype == np.dtype(DEFAULT_COMPUTE_DTYPE)
    weights = (f"weights {' + '.join(formats)}" + (" as stored, as generate, chat and serve run them" if runs and loaded
                                                   else " (random, the seeds' model)" if not loaded
                                                   else f" (converted to {model.dtype.name} for the reference; "
                                                        f"generate, chat and serve run {DEFAULT_COMPUTE_DTYPE} "
                                                        "with the weights as stored)"))
    kernels = "compiled kernels (numba)" if model.backend == "numba" else "NumPy reference"
    products = (", int8 activations (llama.cpp's rounding; batch-invariant: expect error 0)"
                if model.activations == "q8" else "")
    return {"dtype": model.dtype.name, "weights": formats, "weights_as_run": runs, "backend": model.backend,
            "activations": model.activations, "summary": f"{model.dtype.name} compute, {weights}{products}, {kernels}"}


def run(args: argparse.Namespace) -> int:
    seed = validate.seed(args.seed, "--seed", allow_random=False)
    length = validate.int_in_range(args.length, "--length", 2, 1 << 20)
    tolerance = None if args.tolerance is None else fixed_tolerance(args.tolerance)
    spec, tokenizer = grammar_spec(args), None  # a bad grammar or schema fails before the model loads
    if args.dtype is None:  # a model: the path users run; the seeds' tiny model: float64, as it always was
        args.dtype = DEFAULT_COMPUTE_DTYPE if args.model is not None else "float64"
    if args.model is not None:
        from kvlab.loader import load, load_model

        if args.bidirectional:
            raise InputError("--bidirectional is the tiny model's negative control; drop --model")
        path = None if args.model == "default" else args.model
        if spec is None:
            model = load_model(path, dtype=args.dtype, backend=args.backend, activations=args.activations)
        else:  # the grammar is compiled against the model's own vocabulary
            model, tokenizer = load(path, dtype=args.dtype, backend=args.backend, activations=args.activations)
        label = f"{args.model} {args.dtype}"
    else:
        model = TinyLlama(seed=seed, dtype=args.dtype, causal=not args.bidirectional, backend=args.backend)
        label = f"TinyLlama(seed={seed}{', causal=False' if args.bidirectional else ''}) {args.dtype}"
        tokenizer = ByteTokenizer() if spec is not None else None  # the seeds' model reads bytes
    label += f", {model.backend} backend"
    grammar = None if spec is None else compiled_grammar(args, tokenizer, model.config.vocab_size,
                                                         tokenizer.eos_token_ids)
    if grammar is not None:
        label += f", {spec.label} on"
    tolerance = tolerance or default_tolerance(model)
    path = verified_path(model, loaded=args.model is not None)
    results = verify_model(model, tolerance=tolerance, length=length, grammar=grammar, tokenizer=tokenizer)
    passed = all(r.passed for r in results)
    if args.json:
        print(json.dumps({"model": label, "path": path, "passed": passed, "tolerance_rule": tolerance.rule,
                          "rtol": tolerance.rtol, "atol": tolerance.atol, "checks": [
            {"name": r.name, "schedule": r.description, "max_abs_error": r.max_abs_error,
             "max_abs_logit": r.max_abs_logit, "tolerance": r.tolerance, "passed": r.passed}
            for r in results]}, indent=2))
        return 0 if passed else 1
    con = console()
    table = Table(title=f"cached vs full recompute: {label}")
    table.add_column("check")
    table.add_column("schedule")
    table.add_column("max abs error", justify="right")
    table.add_column("tolerance", justify="right")
    table.add_column("verdict")
    for r in results:
        table.add_row(r.name, r.description, f"{r.max_abs_error:.2e}", f"{r.tolerance:.1e}",
                      "[green]ok[/]" if r.passed else "[red]FAIL[/]")
    con.print(table)
    con.print(f"path verified: {path['summary']}", markup=False)
    con.print(f"tolerance = {tolerance.rule}; max|logit| per check "
              f"{min(r.max_abs_logit for r in results):.3g}-{max(r.max_abs_logit for r in results):.3g}",
              markup=False)
    worst = max(results, key=lambda r: r.max_abs_error / r.tolerance if r.tolerance else float("inf"))
    if passed:
        con.print(f"PASS: cached logits equal a full recompute in all {len(results)} schedules (worst: "
                  f"{worst.name}, max abs error {worst.max_abs_error:.2e} <= {worst.tolerance:.1e}).")
        return 0
    failed = ", ".join(r.name for r in results if not r.passed)
    con.print(f"FAIL: cached logits differ from a full recompute in {failed} (worst: {worst.name}, max abs "
              f"error {worst.max_abs_error:.2e} > {worst.tolerance:.1e}).")
    if args.bidirectional:
        con.print("As expected: this model's attention is not causal, so appending a token changes the "
                  "states of earlier positions and their cached keys and values go stale. A KV cache is "
                  "only exact under a causal mask.")
    return 1
