"""Recompute the default model's validation perplexity with transformers.

Why: the model card's perplexity must be checkable offline from the files in
kvlab/models/shakespeare/ alone, and kvlab's own ``kvlab perplexity`` must use
the same windows so the two numbers can be compared.

Windowing (identical to scripts/train_default_model.py at stride = context):
  * ``validation.txt`` is tokenised as one text, without special tokens,
    giving the stream ``s[0..N)``;
  * targets are scored in consecutive blocks ``[i, i + stride)``; for the block
    ending at ``e`` the model reads ``<s> s[b] .. s[e-2]`` with
    ``b = max(0, e - context)`` and predicts ``s[b] .. s[e-1]``; only the
    predictions of ``s[i] .. s[e-1]`` are counted;
  * with the default ``stride = context = 256`` the windows do not overlap:
    each window is ``<s>`` + 255 tokens, predicting 256 tokens, and every
    token of the stream is counted exactly once.

Usage::

    python scripts/eval_default_model.py                  # perplexity
    python scripts/eval_default_model.py --stride 128     # overlapping windows
    python scripts/eval_default_model.py --sample "ROMEO:"  # also generate
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(b, i, e): model reads <s>+s[b:e-1], predicts s[b:e], scores s[i:e]."""
    if not 0 < stride <= context:
        raise ValueError("need 0 < stride <= context")
    out = []
    for i in range(0, n, stride):
        e = min(i + stride, n)
        out.append((max(0, e - context), i, e))
    return out


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: np.ndarray, bos_id: int, context: int,
               stride: int) -> tuple[int, float]:
    """Return (tokens scored, mean negative log-likelihood in nats/token)."""
    total, count = 0.0, 0
    for b, i, e in windows(len(ids), context, stride):
        x = torch.from_numpy(np.concatenate([[bos_id], ids[b : e - 1]])).long()[None]
        y = torch.from_numpy(ids[b:e]).long()
        logits = model(input_ids=x).logits[0].double()
        nll = F.cross_entropy(logits, y, reduction="none")
        total += nll[i - b :].sum().item()
        count += e - i
    return count, total / count


def sample(model: torch.nn.Module, tok, prompt: str, max_new_tokens: int,
           temperature: float, seed: int) -> str:
    """Generate from ``<s> + prompt``; temperature 0 means greedy."""
    ids = [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    torch.manual_seed(seed)
    kwargs = {"do_sample": False} if temperature == 0 else {
        "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(x, max_new_tokens=max_new_tokens, **kwargs)
    return tok.decode(out[0, 1:], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, default=REPO / "kvlab/models/shakespeare")
    parser.add_argument("--text", type=Path, default=None, help="default: <model-dir>/validation.txt")
    parser.add_argument("--context", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument("--stride", type=int, default=None, help="default: = context (no overlap)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sample", action="append", default=[], metavar="PROMPT")
    parser.add_argument("--max-new-tokens", type=int, default=120)
    parser.add_argument("--temperature", type=float, action="append", default=None,
                        help="sampling temperatures (0 = greedy); default: 0 and 0.8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-ppl", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    context = args.context or model.config.max_position_embeddings
    stride = args.stride or context

    if not args.skip_ppl:
        text = (args.text or args.model_dir / "validation.txt").read_text(encoding="utf-8")
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        if args.max_tokens:
            ids = ids[: args.max_tokens]
        t0 = time.perf_counter()
        n, nll = perplexity(model, ids, tok.bos_token_id, context, stride)
        print(f"text: {args.text or 'validation.txt'} ({len(text):,} chars)")
        print(f"windows: context {context}, stride {stride}, <s> prepended to each window")
        print(f"tokens evaluated: {n:,}")
        print(f"mean NLL: {nll:.4f} nats/token ({nll / math.log(2):.4f} bits/token, "
              f"{nll * n / len(text) / math.log(2) if not args.max_tokens else float('nan'):.4f} bits/char)")
        print(f"perplexity: {math.exp(nll):.3f}   ({time.perf_counter() - t0:.1f}s)")

    for prompt in args.sample:
        for temperature in args.temperature or [0.0, 0.8]:
            label = "greedy" if temperature == 0 else f"temperature {temperature}, seed {args.seed}"
            print(f"\n--- {prompt!r}, {label} ---")
            print(sample(model, tok, prompt, args.max_new_tokens, temperature, args.seed))


if __name__ == "__main__":
    main()
