"""`kvlab memory`: analytic K/V cache bytes per token, for T tokens x B sequences, and what fits a budget."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from kvlab.cache.memory import (DTYPE_BYTES, canonical_dtype, kv_bytes_per_token, kv_scale_bytes_per_token,
                                tokens_in_budget)
from kvlab.cli.fmt import console, human_bytes
from kvlab.config import tiny_config
from kvlab.errors import InputError
from kvlab.validate import int_in_range, parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="size the KV cache of a model",
                       description="K/V payload = 2 * layers * batch * kv_heads * tokens * head_dim * bytes.")
    p.add_argument("--config", "--model", dest="config",
                   help="an HF config.json, model folder or .gguf file; default: the tiny seed model")
    p.add_argument("--dtype", help="cache dtype: " + ", ".join(DTYPE_BYTES)
                   + " (default: what kvlab allocates: the compute dtype, float64 for the tiny model, float32 "
                   "for a model, as generate, chat and serve run it)")
    p.add_argument("--tokens", "-c", type=int, default=None, help="cached positions per sequence "
                   "(default: max_position_embeddings)")
    p.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    p.add_argument("--budget", help="memory for the cache, e.g. 8GiB or 1000000: how many tokens fit")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def _default_dtype(path: str | None) -> str:
    """The cache dtype kvlab itself allocates for the model at `path`: the compute dtype, as generate, chat
    and serve use it (K/V are cached in the dtype the model computes in unless --kv-cache-dtype says
    otherwise). The tiny seed model computes in float64; every loaded model in kvlab.loader's default,
    float32, whatever dtype its checkpoint stores (a float16 or bfloat16 checkpoint still computes in
    float32)."""
    from kvlab.loader import DEFAULT_COMPUTE_DTYPE  # lazily: `kvlab memory` loads no model code otherwise

    return "float64" if path is None else DEFAULT_COMPUTE_DTYPE  # TinyLlama (chat --tiny) computes in float64


def gguf_weight_bytes(path: str) -> dict[str, int] | None:
    """Resident weight bytes of a GGUF file's tensors, from its directory alone: kept as stored (what
    `kvlab.load` keeps: block types unpacked as codes + float32 scales/offsets, F16/BF16 half, the rest
    float32) and dequantized to float32 (`weights_dtype="float32"`). None for an HF model."""
    from kvlab.gguf.loader import gguf_file
    from kvlab.gguf.reader import read_gguf
    from kvlab.model.ggml_quants import BLOCK_SIZES, resident_bytes

    found = gguf_file(path)
    if found is None:
        return None
    stored = float32 = 0
    for info in read_gguf(found).tensors.values():
        count = 1
        for size in info.shape:
            count *= size
        float32 += 4 * count
        if len(info.shape) == 2 and info.type_name in BLOCK_SIZES:
            stored += resident_bytes(info.type_name, info.shape)
        else:
            stored += count * (2 if len(info.shape) == 2 and info.type_name in ("F16", "BF16") else 4)
    return {"weights_stored": stored, "weights_float32": float32}


def run(args: argparse.Namespace) -> int:
    from kvlab.loader import model_config

    config = model_config(args.config) if args.config else tiny_config()
    try:
        dtype = canonical_dtype(args.dtype or _default_dtype(args.config))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    budget = parse_size(args.budget, "--budget") if args.budget is not None else None
    int_in_range(args.batch, "--batch", 1, 2**40)
    if args.tokens is not None:
        int_in_range(args.tokens, "--tokens", 0, 2**40)
    tokens = config.max_position_embeddings if args.tokens is None else args.tokens
    per_token = kv_bytes_per_token(config, dtype)
    total = per_token * tokens * args.batch
    result = {
        "model": args.config or "tiny (seed model)",
        "num_hidden_layers": config.num_hidden_layers, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "dtype": dtype, "bytes_per_scalar": DTYPE_BYTES[dtype],
        "bytes_per_token": per_token, "tokens": tokens, "batch": args.batch, "total_bytes": total,
        "bytes_per_token_by_dtype": {d: kv_bytes_per_token(config, d) for d in DTYPE_BYTES},
        "scale_bytes_per_token": kv_scale_bytes_per_token(config, dtype),
        "scale_bytes_per_token_by_dtype": {d: kv_scale_bytes_per_token(config, d) for d in DTYPE_BYTES},
    }
    weights = gguf_weight_bytes(args.config) if args.config else None
    if weights is not None:
        result["weight_bytes_stored"] = weights["weights_stored"]
        result["weight_bytes_float32"] = weights["weights_float32"]
    if budget is not None:
        result["budget_bytes"] = budget
        result["tokens_in_budget"] = tokens_in_budget(config, budget, args.batch, dtype)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0

    con = console()
    con.print(f"[bold]{result['model']}[/]: {config.num_hidden_layers} layers x {config.num_key_value_heads} "
              f"KV heads x head_dim {config.head_dim}")
    con.print(f"K/V bytes per token = 2 x {config.num_hidden_layers} x {config.num_key_value_heads} x "
              f"{config.head_dim} x {DTYPE_BYTES[dtype]:g} B ({dtype}) = [bold]{per_token:,.0f}[/] bytes")
    con.print(f"{tokens:,} tokens x batch {args.batch} = [bold]{total:,.0f}[/] bytes ({human_bytes(total)})")
    if weights is not None:
        con.print(f"weights resident: [bold]{human_bytes(weights['weights_stored'])}[/] as stored (GGUF blocks "
                  f"as codes + float32 scales), {human_bytes(weights['weights_float32'])} dequantized to float32")
    if budget is not None:
        con.print(f"budget {human_bytes(budget)} holds [bold]{result['tokens_in_budget']:,}[/] tokens per "
                  f"sequence at batch {args.batch}")
    scales = result["scale_bytes_per_token"]
    if scales:
        con.print(f"plus scales: a float16 scale and zero per 32 values = [bold]{scales:,.0f}[/] bytes per token "
                  f"of metadata ({human_bytes(scales * tokens * args.batch)} in all)")
    table = Table(title="by cache dtype (payload; int8/int4 add the scales column as metadata)")
    table.add_column("dtype")
    table.add_column("bytes/token", justify="right")
    table.add_column("scales/token", justify="right")
    table.add_column(f"{tokens:,} tok x {args.batch} with scales", justify="right")
    if budget is not None:
        table.add_column("tokens in budget", justify="right")
    for d in DTYPE_BYTES:
        row = [d, f"{kv_bytes_per_token(config, d):,.0f}", f"{kv_scale_bytes_per_token(config, d):,.0f}",
               human_bytes((kv_bytes_per_token(config, d) + kv_scale_bytes_per_token(config, d)) * tokens
                           * args.batch)]
        if budget is not None:
            row.append(f"{tokens_in_budget(config, budget, args.batch, d):,}")
        table.add_row(*row, style="bold" if d == dtype else None)
    con.print(table)
    return 0
