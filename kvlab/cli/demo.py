"""`kvlab demo [PROMPT]`: watch the cache fill, count the work it saves, and check it is exact.

Runs the seeds' TinyLlama (random fixed weights, so the chosen bytes are not language) with the byte
tokenizer: prefill the prompt once, then process one chosen token per step.
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.table import Table

from kvlab.cache.memory import kv_bytes_per_token
from kvlab import validate
from kvlab.cli.fmt import console, human_bytes
from kvlab.errors import ContextLengthError, InputError
from kvlab.model.llama import TinyLlama
from kvlab.tokenizer import ByteTokenizer
from kvlab.verify import verify_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the KV cache step by step on the seeds' tiny model",
                       description="Prefill a prompt, decode a few tokens, and show what the cache holds.")
    p.add_argument("prompt", nargs="?", default="The cat sat", help='prompt text (default "The cat sat")')
    p.add_argument("--steps", type=int, default=6, help="tokens to select (default 6)")
    p.add_argument("--seed", type=int, default=7, help="TinyLlama weight seed (default 7)")
    p.set_defaults(run=run)


def _span(n: int) -> str:
    return f"0-{n - 1} ({n})" if n > 1 else "0 (1)"


def run(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise InputError("the prompt is empty; give at least one character")
    model, tok = TinyLlama(seed=validate.seed(args.seed, "--seed", allow_random=False)), ByteTokenizer()
    prompt = tok.encode(args.prompt)
    context = model.config.max_position_embeddings
    if len(prompt) > context:
        raise ContextLengthError(f"the prompt is {len(prompt)} byte tokens; the tiny model's context is {context}")
    validate.int_in_range(args.steps, "--steps", 1, context - len(prompt) + 1)
    con = console()
    config = model.config
    con.print(f"[bold]TinyLlama(seed={args.seed})[/]: {config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}, {config.num_attention_heads} query heads, {config.num_key_value_heads} KV "
              f"heads x {config.head_dim} channels, float64, byte tokenizer (vocab {config.vocab_size}).")
    con.print(f"Prompt {args.prompt!r} = {len(prompt)} byte tokens. Weights are random: the chosen bytes "
              "are not language, the arithmetic is real.\n")

    table = Table(title="Prefill once, then one token per step (greedy)")
    table.add_column("work just completed")
    table.add_column("positions in each layer's cache")
    table.add_column("newly selected token")
    out = model.forward(np.array([prompt]), use_cache=True, logits_to_keep=1)
    cache = out.cache
    token = int(np.argmax(out.logits[0, -1]))
    table.add_row(f"prefill {args.prompt!r}", _span(cache.get_seq_length()), repr(tok.token_text(token)))
    for _ in range(args.steps - 1):
        previous = token
        out = model.forward(np.array([[token]]), cache=cache, logits_to_keep=1)
        token = int(np.argmax(out.logits[0, -1]))
        table.add_row(f"process {tok.token_text(previous)!r}", _span(cache.get_seq_length()),
                      repr(tok.token_text(token)))
    con.print(table)
    con.print("Position ids start at 0. A selected token enters the cache only when a later forward "
              "processes it, so the last one is not cached yet.\n")

    layers, n_prompt = config.num_hidden_layers, len(prompt)
    with_cache = n_prompt + args.steps - 1
    without = sum(n_prompt + i for i in range(args.steps))
    work = Table(title="K/V rows computed for this run")
    work.add_column("")
    work.add_column("per layer", justify="right")
    work.add_column(f"all {layers} layers", justify="right")
    work.add_row("with the cache", f"{with_cache}", f"{with_cache * layers}")
    work.add_row("recomputing the prefix each step", f"{without}", f"{without * layers}")
    con.print(work)

    report = cache.memory_report()
    keys, values = cache[0]
    per_token = kv_bytes_per_token(config, "float64")
    mem = Table(title="Live memory report")
    mem.add_column("")
    mem.add_column("bytes", justify="right")
    mem.add_column("what", overflow="fold")
    mem.add_row("payload", f"{report.payload_bytes:,}",
                f"K and V, {report.num_tokens} tokens x {per_token:.0f} B/token "
                f"(2x{layers}x{config.num_key_value_heads}x{config.head_dim}x8)")
    mem.add_row("capacity", f"{report.capacity_bytes:,}", f"allocated for {report.capacity_tokens} positions")
    mem.add_row("metadata", f"{report.metadata_bytes:,}", "position ids")
    con.print(mem)
    con.print(f"Each layer holds K {list(keys.shape)} and V {list(values.shape)} "
              f"([batch, KV heads, positions, channels]); total {human_bytes(report.total_bytes)}.\n",
              markup=False)

    results = verify_model(model)
    worst = max(r.max_abs_error for r in results)
    bound = min(r.tolerance for r in results)
    if all(r.passed for r in results):
        con.print(f"verify: [green]PASS[/] - cached logits equal a full recompute in {len(results)} schedules "
                  f"(max abs error {worst:.1e} <= {bound:.1e}). Details: kvlab verify")
        return 0
    con.print(f"verify: [red]FAIL[/] - max abs error {worst:.1e}. Details: kvlab verify")
    return 1
