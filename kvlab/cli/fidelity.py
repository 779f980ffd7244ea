"""`kvlab fidelity`: what each lossy cache (quantized K/V, eviction policy, or both) costs in quality.

Runs the exact cache and every choice on the same held-out text (default: the shipped model and its
validation.txt) and prints, per choice, KL from the exact distribution (mean, max), top-1 agreement,
perplexity and its change, K/V bytes per token (scales included) and the most the cache held, and decode
tokens/s. The table goes to stdout (`--json` for machines); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvlab.cli.fmt import console, human_bytes
from kvlab.errors import InputError
from kvlab.fidelity import DEFAULT_CHOICES, FidelityRow, measure_fidelity, weight_fidelity
from kvlab.policies.parse import POLICY_FORMS
from kvlab.loader import read_float_weights
from kvlab.model.quantized import QUANTIZE_TYPES, weight_choice


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="measure what quantized or windowed caches change",
                       description="Compare cache choices with the exact cache on held-out text. A choice is "
                                   "a cache dtype (int8, int4, int8-channel, fp8_e4m3, fp8_e5m2, float16, "
                                   "bfloat16), a policy (" + POLICY_FORMS + "), or dtype+policy "
                                   "(int8+sinks:4:60).")
    p.add_argument("-m", "--model", help="HF model folder or .gguf file (default: the shipped Shakespeare model)")
    p.add_argument("--text", help="text file (default: validation.txt in the model folder)")
    p.add_argument("--policy", "--policies", dest="policies", action="append", metavar="CHOICE",
                   help="a cache choice, repeatable or comma-separated (default: "
                        + ",".join(DEFAULT_CHOICES) + ")")
    p.add_argument("--weights", metavar="TYPES", default=None,
                   help="measure weight quantization instead: GGUF types, comma-separated ("
                        + ",".join(QUANTIZE_TYPES) + "), each against the float32 weights (KL, top-1, "
                        "perplexity, bytes per weight), as llama-perplexity --kl-divergence does; a type "
                        "with +q8 (q4_0+q8) also rounds the products' inputs to int8, as llama.cpp does")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="score the first N tokens of the text (default 512; 0 = all)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per window, each opened by <bos> (default: the model's context)")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32 (default) or float64")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw perplexity change vs K/V bytes (matplotlib)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import kvlab

    if args.max_tokens < 0:
        raise InputError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    choices = [c.strip() for entry in (args.policies or [",".join(DEFAULT_CHOICES)])
               for c in entry.split(",") if c.strip()]
    if args.plot:  # refuse before the long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("--plot needs matplotlib: pip install 'kvlab[plot]'") from None
    if args.weights is not None:
        kinds = [t.strip() for t in args.weights.split(",") if t.strip()]
        for kind in kinds:
            weight_choice(kind)  # refused before loading
        if not kinds:
            raise InputError("--weights needs at least one type, e.g. --weights q8_0,q4_0")
    model, tokenizer = kvlab.load(args.model, dtype=args.dtype)
    folder = Path(args.model) if args.model else kvlab.hf.DEFAULT_MODEL_DIR
    folder = folder.parent if folder.is_file() else folder  # a .gguf file: look beside it
    text_path = Path(args.text) if args.text else folder / "validation.txt"
    if not text_path.is_file():
        raise InputError(f"{text_path}: no such text file (give --text)")
    ids = tokenizer.encode(text_path.read_text(encoding="utf-8"), add_bos=False)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    err = console(stderr=True)
    started = time.perf_counter()
    if args.weights is not None:
        return run_weights(args, kinds, ids, tokenizer.bos_token_id, folder, text_path, err, started)
    with err.status("measuring") as status:
        rows = measure_fidelity(model, ids, tokenizer.bos_token_id, choices, args.context,
                                progress=lambda line: status.update(line))
    err.print(f"{len(ids):,} tokens x {len(rows)} choices in {time.perf_counter() - started:.0f}s "
              f"(decode speeds are from one shared machine: compare them with each other)")
    if args.plot:
        plot(rows, args.plot, f"{folder.name}: {rows[0].tokens:,} tokens of {text_path.name}")
        err.print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({"model": str(folder), "text": str(text_path), "tokens": rows[0].tokens,
                          "context": args.context or model.config.max_position_embeddings,
                          "rows": [r.to_dict() for r in rows]}, indent=2))
        return 0
    out = console()
    if not out.is_terminal:  # nine columns do not fit the 80-column default of pipes and logs
        out = Console(highlight=False, width=120)
    out.print(table(rows, f"fidelity vs the exact cache: {folder.name}, {rows[0].tokens:,} tokens"))
    return 0


def run_weights(args: argparse.Namespace, kinds: list[str], ids: list[int], bos: int, folder: Path,
                text_path: Path, err: Console, started: float) -> int:
    config, weights = read_float_weights(args.model)
    with err.status("measuring") as status:
        rows = weight_fidelity(config, weights, ids, bos, kinds, args.context,
                               progress=lambda line: status.update(line))
    err.print(f"{len(ids):,} tokens x {len(rows)} weight types in {time.perf_counter() - started:.0f}s")
    if args.json:
        print(json.dumps({"model": str(folder), "text": str(text_path), "tokens": rows[0].tokens,
                          "rows": [r.to_dict() for r in rows]}, indent=2))
        return 0
    t = Table(title=f"weight quantization vs float32: {folder.name}, {rows[0].tokens:,} tokens")
    for name in ("weights", "KL mean", "KL max", "top-1", "ppl", "Δppl", "file B/weight", "kvlab B/weight"):
        t.add_column(name, justify="left" if name == "weights" else "right", no_wrap=True)
    for r in rows:
        t.add_row(r.name, f"{r.kl_mean:.2e}", f"{r.kl_max:.2e}", f"{100 * r.top1_agreement:.2f}%",
                  f"{r.perplexity:.3f}", f"{100 * r.perplexity_change:+.2f}%", f"{r.file_bytes_per_weight:.4f}",
                  f"{r.resident_bytes_per_weight:.4f}")
    out = console()
    if not out.is_terminal:
        out = Console(highlight=False, width=120)
    out.print(t)
    return 0


def table(rows: list[FidelityRow], title: str) -> Table:
    exact_bytes = rows[0].bytes_per_token
    t = Table(title=title)
    for name, justify in [("cache", "left"), ("KL mean", "right"), ("KL max", "right"), ("top-1", "right"),
                          ("ppl", "right"), ("Δppl", "right"), ("B/token", "right"), ("peak", "right"),
                          ("tok/s", "right")]:
        t.add_column(name, justify=justify, no_wrap=True)
    for r in rows:
        t.add_row(r.name, f"{r.kl_mean:.2e}", f"{r.kl_max:.2e}", f"{100 * r.top1_agreement:.2f}%",
                  f"{r.perplexity:.3f}", f"{100 * r.perplexity_change:+.2f}%",
                  f"{r.bytes_per_token:,.0f} ({100 * r.bytes_per_token / exact_bytes:.0f}%)",
                  human_bytes(r.peak_bytes), f"{r.decode_tokens_per_s:.0f}")
    return t


def plot(rows: list[FidelityRow], path: str, title: str) -> None:
    """Perplexity change against the most K/V bytes each choice held, one labelled point per choice."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for r in rows:
        left.scatter(r.peak_bytes / 1024, 100 * r.perplexity_change)
        left.annotate(r.name, (r.peak_bytes / 1024, 100 * r.perplexity_change), fontsize=7,
                      xytext=(3, 3), textcoords="offset points")
    left.axhline(0, color="gray", linewidth=0.5)
    left.set_xlabel("most K/V bytes held (KiB, scales included)")
    left.set_ylabel("perplexity change vs exact (%)")
    names = [r.name for r in rows]
    right.barh(names, [max(r.kl_mean, 1e-12) for r in rows])
    right.set_xscale("log")
    right.invert_yaxis()
    right.set_xlabel("mean KL from the exact distribution (nats, log scale)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
