"""`kvlab perplexity`: validation perplexity of a model (default: the shipped model on its held-out text)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvlab import validate
from kvlab.cli.model_flags import add_activations_flag
from kvlab.errors import InputError
from kvlab.perplexity import perplexity


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity on held-out text",
                       description="Perplexity with non-overlapping (or strided) windows; <bos> opens each.")
    p.add_argument("-m", "--model", help="HF model folder or .gguf file (default: the shipped Shakespeare model)")
    p.add_argument("--text", help="text file (default: validation.txt in the model folder)")
    p.add_argument("--context", type=int, default=None, help="window length (default: model context)")
    p.add_argument("--stride", type=int, default=None, help="scored tokens per window (default: context)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="float32 (default), float16, bfloat16, int8, int4, fp8_e4m3 or fp8_e5m2")
    p.add_argument("--chunk", type=int, default=None,
                   help="feed each window through the cache in chunks of N tokens (default: one forward)")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32 (default) or float64")
    add_activations_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import kvlab

    for flag in ("context", "stride", "max_tokens", "chunk"):
        validate.optional_int(getattr(args, flag), f"--{flag.replace('_', '-')}", 1)
    model, tokenizer = kvlab.load(args.model, dtype=args.dtype, activations=args.activations)
    folder = Path(args.model) if args.model else kvlab.hf.DEFAULT_MODEL_DIR
    folder = folder.parent if folder.is_file() else folder  # a .gguf file: look beside it
    text_path = Path(args.text) if args.text else folder / "validation.txt"
    if not args.text and not text_path.is_file():
        raise InputError(f"{text_path}: no such text file (give --text)")
    text = validate.read_text(text_path, "text file")
    ids = tokenizer.encode(text, add_bos=False)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    if tokenizer.bos_token_id is None:
        raise InputError("this tokenizer has no <bos> token, which perplexity windows start with")
    start = time.perf_counter()
    result = perplexity(model, ids, tokenizer.bos_token_id, args.context, args.stride,
                        kv_dtype=args.kv_cache_dtype, chunk=args.chunk)
    context = args.context or model.config.max_position_embeddings
    print(f"text: {text_path} ({len(text):,} chars)")
    print(f"windows: context {context}, stride {args.stride or context}, <bos> prepended to each window")
    print(f"kv cache dtype: {args.kv_cache_dtype or args.dtype}; compute dtype: {args.dtype}")
    print(f"tokens evaluated: {result.tokens:,}")
    print(f"mean NLL: {result.mean_nll:.4f} nats/token ({result.bits_per_token:.4f} bits/token)")
    print(f"perplexity: {result.perplexity:.3f}   ({time.perf_counter() - start:.1f}s)")
    return 0
