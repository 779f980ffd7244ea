"""Decode speed by cache dtype, contiguous cache and engine block pool, against the memory roofline.

A random model of SmolLM2-135M's shape (30 layers, 3 KV heads of 64) decodes `--steps` tokens after
`--contexts` positions of random K/V, stored in each cache dtype (no prefill is timed):

  * contiguous: a KVCache filled by `KVCache.from_arrays`, one `model.forward` per step (the fused decode
    step: ContiguousAttention's decode kernel reads the cache in place);
  * engine: a BlockPool of 16-token blocks filled through the slot mapping, one `model.forward_batch`
    per step with a decode BatchInput, as the engine's model runner builds it (PagedAttention).

Every layout and dtype is timed in alternating rounds, and the streaming-read bandwidth (bench/roofline.py)
is measured in each round too; the best round is kept. Columns: ms/token; the ratio to float32 in the
same layout; the bytes a step reads (weights as stored + the cache's K/V payload and scales) over float32's;
the issue's bound for a quantized cache (time <= 1.1 x bytes ratio x float32's time); and the time over
the roofline (bytes / bandwidth). The machine is shared: compare ratios of one run, not absolute times.

    PYTHONPATH=. python bench/bench_kv_quant.py [--threads 2] [--contexts 128 1024 4096] [--steps 8]
        [--repeats 3] [--weights float32] [--layouts contiguous engine]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--weights", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--layouts", nargs="+", default=["contiguous", "engine"], choices=["contiguous", "engine"])
    p.add_argument("--dtypes", nargs="+",
                   default=["float32", "bfloat16", "float16", "int8", "int4", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--backend", default="numba", choices=["numba", "numpy"])
    return p.parse_args()


ARGS = parse_args()
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvlab
from kvlab.cache.kv_cache import KVCache, resolve_kv_dtype  # noqa: E402
from kvlab.cache.paged import BlockPool, slot_mapping, write_slots  # noqa: E402
from kvlab.config import ModelConfig  # noqa: E402
from kvlab.model.batch import BatchInput  # noqa: E402
from kvlab.model.llama import LlamaModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import measure_bandwidth  # noqa: E402 (bench/roofline.py)

from shapes import SMOLLM2_135M  # noqa: E402 (bench/shapes.py)

SHAPE = SMOLLM2_135M
BLOCK_SIZE = 16


def random_kv(config: ModelConfig, context: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    shape = (1, config.num_key_value_heads, context, config.head_dim)
    return ([rng.standard_normal(shape, dtype=np.float32) for _ in range(config.num_hidden_layers)],
            [rng.standard_normal(shape, dtype=np.float32) for _ in range(config.num_hidden_layers)])


class Contiguous:
    """A filled KVCache, cropped back to `context` before each round."""

    def __init__(self, model: LlamaModel, kv: tuple, context: int, dtype: str) -> None:
        self.model, self.context = model, context
        self.cache = KVCache.from_arrays(model.cache_spec, *kv, np.arange(context), kv_dtype=dtype)
        self.cache.store.reserve(context + ARGS.steps + 1)
        report = self.cache.memory_report()
        self.kv_bytes = (report.payload_bytes + report.scale_bytes) / context  # per position

    def run(self) -> float:
        self.cache.crop(self.context)
        token = np.array([[1]])
        start = time.perf_counter()
        for _ in range(ARGS.steps):
            self.model.forward(token, cache=self.cache, logits_to_keep=1)
        return (time.perf_counter() - start) / ARGS.steps


class PoolDecode:
    """A block pool holding one sequence of `context` positions; each step decodes one more token through
    `forward_batch` (the engine's path), so the rows written by a round are rewritten by the next."""

    def __init__(self, model: LlamaModel, kv: tuple, context: int, dtype: str) -> None:
        c = model.config
        self.model, self.context = model, context
        blocks = -(-(context + ARGS.steps + 1) // BLOCK_SIZE)
        self.pool = BlockPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                              resolve_kv_dtype(dtype, np.float32), BLOCK_SIZE, blocks + 1, np.float32)
        self.table = list(np.random.default_rng(1).permutation(blocks + 1)[:blocks])  # blocks in no order
        slots = slot_mapping(self.table, 0, context, BLOCK_SIZE)
        for layer, (k, v) in enumerate(zip(*kv)):
            write_slots(self.pool.key_cache[layer], self.pool.value_cache[layer], slots,
                        k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))
        self.kv_bytes = self.pool.bytes_per_block / BLOCK_SIZE  # per position, scales included

    def run(self) -> float:
        start = time.perf_counter()
        for step in range(ARGS.steps):
            position = self.context + step
            batch = BatchInput(token_ids=np.array([1]), positions=np.array([position]), query_lens=[1],
                               context_lens=[position + 1], block_tables=[self.table],
                               slot_mapping=slot_mapping(self.table, position, 1, BLOCK_SIZE),
                               logits_indices=np.array([0]))
            self.model.forward_batch(batch, self.pool)
        return (time.perf_counter() - start) / ARGS.steps


def main() -> None:
    config = ModelConfig(**SHAPE)
    weights_dtype = None if ARGS.weights == "float32" else ARGS.weights
    model = LlamaModel(config, dtype=np.float32, seed=0, weights_dtype=weights_dtype, backend=ARGS.backend)
    weight_bytes = 4 if ARGS.weights == "float32" else 2
    matrices = sum(getattr(layer, n).size for layer in model.layers for n in ("w_qkv", "w_o", "w_gate_up", "w_down"))
    weights_read = (matrices + model.lm_head.size) * weight_bytes
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    layouts = {"contiguous": Contiguous, "engine": PoolDecode}
    rows = []
    for context in ARGS.contexts:
        kv = random_kv(config, context)
        runs = {(layout, d): layouts[layout](model, kv, context, d) for layout in ARGS.layouts for d in ARGS.dtypes}
        del kv
        for r in runs.values():
            r.run()  # compile or load the kernels, touch the pages
        best = {key: float("inf") for key in runs}
        bandwidth = 0.0
        for _ in range(ARGS.repeats):
            bandwidth = max(bandwidth, measure_bandwidth(3))
            for key, r in runs.items():
                best[key] = min(best[key], r.run())
        for (layout, dtype), r in runs.items():
            step_bytes = weights_read + r.kv_bytes * context
            rows.append({"context": context, "layout": layout, "cache": dtype, "seconds": best[(layout, dtype)],
                         "step_bytes": step_bytes, "bandwidth": bandwidth,
                         "roofline": step_bytes / bandwidth})
        del runs
    print(f"SmolLM2-135M shape, random {ARGS.weights} weights, float32 compute, {ARGS.backend} backend, "
          f"{ARGS.threads} threads, {cpu}; best of {ARGS.repeats} alternating rounds of {ARGS.steps} decode "
          f"steps; load average {os.getloadavg()[0]:.1f} (a shared machine: compare ratios within a context)")
    print(f"{'context':>7} {'layout':>10} {'cache':>9} {'ms/tok':>7} {'vs f32':>7} {'bytes':>6} {'bound':>6} "
          f"{'x roof':>7} {'GB/s':>5}")
    for r in rows:
        base = next(b for b in rows if b["context"] == r["context"] and b["layout"] == r["layout"]
                    and b["cache"] == "float32")
        r["vs_float32"] = r["seconds"] / base["seconds"]
        r["bytes_vs_float32"] = r["step_bytes"] / base["step_bytes"]
        r["goal"] = 1.1 * r["bytes_vs_float32"]
        print(f"{r['context']:>7} {r['layout']:>10} {r['cache']:>9} {1e3 * r['seconds']:>7.2f} "
              f"{r['vs_float32']:>6.2f}x {r['bytes_vs_float32']:>6.3f} {r['goal']:>6.3f} "
              f"{r['seconds'] / r['roofline']:>6.2f}x {r['bandwidth'] / 1e9:>5.1f}")
    OUT.mkdir(exist_ok=True)
    (OUT / f"bench_kv_quant_{ARGS.weights}.json").write_text(json.dumps(
        {"cpu": cpu, "threads": ARGS.threads, "weights": ARGS.weights, "backend": ARGS.backend,
         "load_average": os.getloadavg()[0], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
