"""Decode speed with quantized K/V caches, side by side with float32, at a few context lengths.

A random model of SmolLM2-135M's shape (30 layers, 3 KV heads of 64) decodes `--steps` tokens after a
cache of `--contexts` positions filled with random K/V (`KVCache.from_arrays`, so no prefill is timed).
Each cache dtype is timed in alternating rounds and the best round is kept; the table gives ms/token, the
ratio to float32 in the same run, and the K/V bytes (scales included). In NumPy a quantized cache is
dequantized into a float copy at every step, so it saves memory and costs time; this measures how much.

    PYTHONPATH=. python bench/bench_kv_quant.py [--threads 1] [--contexts 256 2048] [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16", "int8", "int4", "fp8_e4m3"])
    return p.parse_args()


ARGS = parse_args()
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402

from kvlab.cache.kv_cache import KVCache  # noqa: E402
from kvlab.cli.fmt import human_bytes  # noqa: E402
from kvlab.config import ModelConfig  # noqa: E402
from kvlab.model.llama import LlamaModel  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
             rope_theta=100000.0, max_position_embeddings=4096)


def filled_cache(model: LlamaModel, context: int, kv_dtype: str) -> KVCache:
    c = model.config
    rng = np.random.default_rng(0)
    shape = (1, c.num_key_value_heads, context, c.head_dim)
    keys = [rng.standard_normal(shape, dtype=np.float32) for _ in range(c.num_hidden_layers)]
    values = [rng.standard_normal(shape, dtype=np.float32) for _ in range(c.num_hidden_layers)]
    return KVCache.from_arrays(model.cache_spec, keys, values, np.arange(context), kv_dtype=kv_dtype)


def main() -> None:
    model = LlamaModel(ModelConfig(**SHAPE), dtype=np.float32, seed=0)
    print(f"SmolLM2-135M shape, random weights, float32 compute, {ARGS.threads} thread(s); best of "
          f"{ARGS.repeats} alternating rounds of {ARGS.steps} decode steps (shared machine: compare ratios)")
    print(f"{'context':>8} {'cache':>10} {'ms/token':>9} {'vs f32':>7} {'K/V bytes':>12}")
    for context in ARGS.contexts:
        caches = {d: filled_cache(model, context, d) for d in ARGS.dtypes}
        best = {d: float("inf") for d in ARGS.dtypes}
        for _ in range(ARGS.repeats):
            for dtype, cache in caches.items():
                cache.crop(context)
                token = np.array([[1]])
                start = time.perf_counter()
                for _ in range(ARGS.steps):
                    model.forward(token, cache=cache, logits_to_keep=1)
                best[dtype] = min(best[dtype], (time.perf_counter() - start) / ARGS.steps)
        for dtype, cache in caches.items():
            report = cache.memory_report()
            per_token = (report.payload_bytes + report.scale_bytes) / cache.get_seq_length()
            print(f"{context:>8} {dtype:>10} {1e3 * best[dtype]:>9.1f} {best[dtype] / best['float32']:>6.2f}x "
                  f"{human_bytes(per_token * context):>12}")


if __name__ == "__main__":
    main()
