"""Train kvlab's default model: a small Llama on Shakespeare, on CPU.

Why: kvlab needs a real (not random) Llama-architecture model that ships with
the package, so `kvlab generate` produces text offline and lossy KV-cache
policies can be compared by validation perplexity.  torch and transformers are
training-only dependencies; kvlab itself runs the saved safetensors in NumPy.

The run is deterministic given ``--seed``: parameters are initialised after
``torch.manual_seed(seed)`` and the batch order comes from
``numpy.random.default_rng(seed)``.

Data layout (see scripts/prepare_shakespeare.py, which must run first):
  * every training work is tokenised on its own (no special tokens) and the
    works are concatenated with ``</s>`` between them into one token stream;
  * a training example is a random 256-token slice ``t`` of that stream; the
    model reads ``<s> t[0] .. t[254]`` and predicts ``t[0] .. t[255]``, so
    position 0 always holds ``<s>`` exactly as at inference time;
  * validation uses the same ``<s>``-prefixed windows, but non-overlapping and
    in order over ``validation.txt`` (see scripts/eval_default_model.py).

Reproduce the shipped model::

    python scripts/prepare_shakespeare.py
    python scripts/train_default_model.py          # defaults = shipped run
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
BOS_ID, EOS_ID = 0, 1


@dataclass
class TrainArgs:
    data_dir: str = str(REPO / "data/shakespeare")
    model_dir: str = str(REPO / "kvlab/models/shakespeare")
    checkpoint_dir: str = str(REPO / "data/checkpoints")
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 512
    context: int = 256
    rope_theta: float = 10000.0
    batch_size: int = 16
    steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    threads: int = 2
    log_every: int = 25
    eval_every: int = 200
    eval_windows: int = 48  # windows for the periodic (partial) validation loss
    calibrate: int = 0  # >0: run this many steps, report throughput, save nothing


def parse_args() -> TrainArgs:
    defaults = TrainArgs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return TrainArgs(**vars(parser.parse_args()))


def load_streams(args: TrainArgs) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """Token streams: train = works joined by </s>; validation = validation.txt."""
    tok = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    splits = json.loads((Path(args.data_dir) / "splits.json").read_text())
    train: list[int] = []
    for work in splits["train"]:
        text = (Path(args.data_dir) / "works" / f"{work}.txt").read_text(encoding="utf-8")
        train.extend(tok.encode(text, add_special_tokens=False).ids)
        train.append(EOS_ID)
    val_text = (Path(args.model_dir) / "validation.txt").read_text(encoding="utf-8")
    val = tok.encode(val_text, add_special_tokens=False).ids
    return tok, np.asarray(train, dtype=np.int64), np.asarray(val, dtype=np.int64)


def eval_windows(stream: np.ndarray, context: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Non-overlapping windows: input <s>+chunk[:-1], targets chunk (len <= context).

    Every token of the stream is predicted exactly once.
    """
    out = []
    for start in range(0, len(stream), context):
        chunk = stream[start : start + context]
        out.append((np.concatenate([[BOS_ID], chunk[:-1]]), chunk))
    return out


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: list[tuple[np.ndarray, np.ndarray]],
             batch_size: int = 16) -> tuple[float, int]:
    """Mean NLL (nats/token) and token count over the given windows."""
    model.eval()
    total, count = 0.0, 0
    full = [w for w in windows if len(w[1]) == len(windows[0][1])]
    rest = [w for w in windows if len(w[1]) != len(windows[0][1])]
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in rest]
    for group in groups:
        x = torch.from_numpy(np.stack([w[0] for w in group]))
        y = torch.from_numpy(np.stack([w[1] for w in group]))
        logits = model(input_ids=x).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")
        total += nll.item()
        count += y.numel()
    model.train()
    return total / count, count


def lr_at(step: int, args: TrainArgs) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def build_model(args: TrainArgs, vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        use_cache=True,
    )
    model = LlamaForCausalLM(config)
    return model.float()


def make_optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on RMSNorm gains)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def save(model: LlamaForCausalLM, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
        max_length=model.config.max_position_embeddings,
    )
    model.save_pretrained(out_dir, safe_serialization=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    rng = np.random.default_rng(args.seed)

    tok, train, val = load_streams(args)
    model = build_model(args, tok.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train tokens {len(train):,}  val tokens {len(val):,}  params {n_params:,}")
    print(json.dumps(asdict(args)))
    opt = make_optimizer(model, args)

    val_windows = eval_windows(val, args.context)
    # A fixed, evenly spread subset for cheap periodic validation.
    pick = np.linspace(0, len(val_windows) - 2, args.eval_windows).round().astype(int)
    val_subset = [val_windows[i] for i in sorted(set(pick.tolist()))]
    # Train loss measured the same way as validation, on a fixed slice of train.
    train_probe = eval_windows(train[: len(val)], args.context)

    steps = args.calibrate or args.steps
    span = args.context  # targets per example; inputs are <s> + first span-1 targets
    model.train()
    t0 = time.perf_counter()
    t_log, running, n_running = t0, 0.0, 0
    history: list[dict[str, float]] = []
    for step in range(steps):
        offsets = rng.integers(0, len(train) - span, size=args.batch_size)
        y_np = np.stack([train[o : o + span] for o in offsets])
        x_np = np.concatenate([np.full((args.batch_size, 1), BOS_ID), y_np[:, :-1]], axis=1)
        x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        running += loss.item()
        n_running += 1

        done = step + 1
        if done % args.log_every == 0 or done == steps:
            now = time.perf_counter()
            tok_s = n_running * args.batch_size * span / (now - t_log)
            print(f"step {done:5d}/{steps}  train_loss {running / n_running:.4f}  "
                  f"lr {lr_at(step, args):.2e}  {tok_s:,.0f} tok/s  elapsed {now - t0:,.0f}s",
                  flush=True)
            history.append({"step": done, "train_loss": running / n_running, "elapsed_s": now - t0})
            t_log, running, n_running = now, 0.0, 0
        if not args.calibrate and (done % args.eval_every == 0 and done != steps):
            v, _ = evaluate(model, val_subset)
            print(f"step {done:5d}  val_loss(subset) {v:.4f}  ppl {math.exp(v):.2f}", flush=True)
            history.append({"step": done, "val_loss_subset": v})
            save(model, Path(args.checkpoint_dir) / "latest")

    elapsed = time.perf_counter() - t0
    if args.calibrate:
        print(f"calibration: {steps} steps in {elapsed:.1f}s = "
              f"{steps * args.batch_size * span / elapsed:,.0f} tok/s, {elapsed / steps:.3f} s/step")
        return

    train_loss, _ = evaluate(model, train_probe)
    val_loss, n_val = evaluate(model, val_windows)
    print(f"final: train_loss {train_loss:.4f} (ppl {math.exp(train_loss):.2f}, first {len(val):,} "
          f"train tokens)  val_loss {val_loss:.4f}  val_ppl {math.exp(val_loss):.3f} "
          f"over {n_val:,} tokens  training {elapsed / 60:.1f} min", flush=True)
    save(model, Path(args.model_dir))
    metrics = {
        "params": n_params,
        "train_tokens_seen": steps * args.batch_size * span,
        "train_stream_tokens": int(len(train)),
        "training_seconds": elapsed,
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "final_val_ppl": math.exp(val_loss),
        "val_tokens": n_val,
        "args": asdict(args),
        "history": history,
    }
    Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.checkpoint_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


if __name__ == "__main__":
    main()
