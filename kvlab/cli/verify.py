"""`kvlab verify`: cached vs full-recompute logits over several schedules; non-zero exit on any mismatch."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from kvlab.cli.fmt import console
from kvlab.cli.model_flags import add_activations_flag
from kvlab.cli.sampling_flags import add_grammar_flags, compiled_grammar, grammar_spec
from kvlab.errors import InputError
from kvlab.model.llama import TinyLlama
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
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="compute dtype (default float64)")
    p.add_argument("--backend", choices=["auto", "numba", "numpy"], default="auto",
                   help="compiled kernels (numba, the default where available) or the NumPy reference")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    add_activations_flag(p)
    add_grammar_flags(p)  # with a grammar on: constrained greedy tokens and masked logits in every schedule
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    seed = validate.seed(args.seed, "--seed", allow_random=False)
    length = validate.int_in_range(args.length, "--length", 2, 1 << 20)
    tolerance = None if args.tolerance is None else fixed_tolerance(args.tolerance)
    spec, tokenizer = grammar_spec(args), None  # a bad grammar or schema fails before the model loads
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
    results = verify_model(model, tolerance=tolerance, length=length, grammar=grammar, tokenizer=tokenizer)
    passed = all(r.passed for r in results)
    if args.json:
        print(json.dumps({"model": label, "passed": passed, "tolerance_rule": tolerance.rule,
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
