"""Decode step time of two kvlab trees side by side (e.g. a commit before and after a refactor), one run.

Each tree runs in its own worker process (its own imports, numba cache and threads) on the same random
SmolLM2-135M-shaped model; the workers take turns, round by round, swapping who goes first, so drift on a
shared machine hits both alike. Prints, per config, best-of-rounds ms/step of each tree, their ratio, and
the median of the per-round ratios (the figure to quote: one noisy round cannot move it much).

    git worktree add /tmp/kvlab-old <commit>
    python bench/bench_ab_decode.py --old /tmp/kvlab-old --new . \\
        [--configs numba-f32-1:128 numba-bf16-1:128 numba-f32-16:128] [--rounds 6] [--steps 24]

A config is BACKEND-WEIGHTS-BATCH[-CACHE]:CONTEXT, WEIGHTS f32, bf16 or a block type kept as stored (q8_0,
q4_0, q4_1, q5_0, q5_1: quantized at load, both trees must have kvlab.model.quantized; "+q8" after one,
e.g. q8_0+q8, rounds the products' inputs to int8: `activations="q8"`), CACHE a K/V cache
dtype (float16, int8, int4, fp8_e4m3, ...; default the compute dtype), e.g. numba-f32-1-int8:4096.
WEIGHTS `file` runs the model `--model PATH` loads (a GGUF file or HF folder, kvlab's defaults: e.g. a 1B
Q4_K_M file's int8-activation products), e.g. `--model llama1b-Q4_K_M.gguf --configs numba-file-1:128`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r'''
import json, statistics, sys, time
import numpy as np
from kvlab.config import ModelConfig
from kvlab.model.llama import LlamaModel
from kvlab.model.weights import random_weights
from kvlab.progress import compiling_kernels

config = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                     rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
models, model_path, weights = {}, sys.argv[1], None
print("ready", flush=True)
for line in sys.stdin:
    name, context, steps = line.split()
    context, steps = int(context), int(steps)
    backend, kind, batch, *cache_dtype = name.split("-", 3)
    if name not in models:
        if kind != "file" and weights is None:  # made once, only when a config needs them
            weights = random_weights(config, 0, np.float32)
        if kind == "file":  # the model --model names, as kvlab loads it by default
            import kvlab
            models[name] = kvlab.load(model_path)[0]
        elif kind in ("f32", "bf16"):
            models[name] = LlamaModel(config, weights, dtype=np.float32, backend=backend,
                                      weights_dtype=None if kind == "f32" else "bfloat16")
        else:  # a GGUF block type, quantized at load with llama.cpp's encoder and kept as stored
            from kvlab.model.quantized import quantize_weights
            kind, _, activations = kind.partition("+")  # "q8_0+q8": inputs rounded to int8 (both trees need it)
            extra = {"activations": activations} if activations else {}
            models[name] = LlamaModel(config, quantize_weights(weights, kind), dtype=np.float32, backend=backend,
                                      **extra)
        with compiling_kernels():  # first run only: said, and never inside a timed step
            models[name].warm_up()
    model, batch = models[name], int(batch)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, context + steps))
    cache = model.new_cache(batch, kv_dtype=cache_dtype[0] if cache_dtype else None, capacity=context + steps + 1)
    model.forward(ids[:, :context], cache=cache, logits_to_keep=1)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        model.forward(ids[:, context + i:context + i + 1], cache=cache)
        times.append(time.perf_counter() - start)
    print(json.dumps({"median_ms": 1000 * statistics.median(times)}), flush=True)
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the first tree (a folder holding kvlab/)")
    p.add_argument("--new", required=True, help="the second tree")
    p.add_argument("--configs", nargs="+", default=["numba-f32-1:128", "numba-bf16-1:128", "numba-f32-16:128"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--model", default="", help="the model a `file` config loads (GGUF file or HF folder)")
    args = p.parse_args()
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    workers = {}
    for key, root in trees.items():
        env = dict(os.environ, PYTHONPATH=root)
        env.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default: the worker imports NumPy first
        workers[key] = subprocess.Popen([sys.executable, "-c", WORKER, os.path.abspath(args.model) if args.model
                                         else ""], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env, cwd=root)
        assert workers[key].stdout.readline().strip() == "ready"
    configs = [c.split(":") for c in args.configs]
    times = {(name, ctx, key): [] for name, ctx in configs for key in trees}
    try:
        for r in range(args.rounds):
            for name, ctx in configs:
                for key in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
                    worker = workers[key]
                    worker.stdin.write(f"{name} {ctx} {args.steps}\n")
                    worker.stdin.flush()
                    times[(name, ctx, key)].append(json.loads(worker.stdout.readline())["median_ms"])
    finally:
        for worker in workers.values():
            worker.stdin.close()
            worker.wait()
    print(f"old {trees['old']}\nnew {trees['new']}\n{args.rounds} alternating rounds, {args.steps} steps each")
    for name, ctx in configs:
        old, new = times[(name, ctx, "old")], times[(name, ctx, "new")]
        ratios = [b / a for a, b in zip(old, new)]
        print(f"{name:16s} ctx {ctx:>5s}: old {min(old):7.2f} ms  new {min(new):7.2f} ms  best/best "
              f"{min(new) / min(old):.3f}  median per-round new/old {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
