"""kvlab vs transformers on a real checkpoint, against the memory-bandwidth roofline, in one run.

A random model of SmolLM2-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads,
vocab 49152, tied embeddings, rope_theta 100000) is saved by transformers in float32 to bench/out/ (once)
and loaded by both engines. With the same thread count, side by side at each context length:

  * decode ms/token: kvlab's forward with its KV cache, and transformers' `generate` with its cache (each
    token's arrival timed through a streamer): the median step;
  * prefill tokens/s: one forward over the prompt, up to the first new token (both);
  * the roofline: bytes one decode step must read (every weight once, the LM head once, the K/V cache at
    that context) divided by the read bandwidth this script measures with a large (512 MiB) sgemv;
  * the gemv floor: the time of just the step's matrix-vector products (four per layer, the LM head) on
    kvlab's own weight arrays, back to back. It separates what OpenBLAS achieves on these small cold
    matrices (floor vs roofline) from everything else kvlab does in a step (kvlab vs floor).

    python bench/bench_hf_decode.py [--threads 2] [--contexts 128 1024] [--steps 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
             rope_theta=100000.0, max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=0,
             eos_token_id=0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per context and engine")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best round is reported")
    p.add_argument("--model-dir", type=Path, default=OUT / "smollm2-135m-shape-f32")
    p.add_argument("--no-transformers", action="store_true")
    return p.parse_args()


ARGS = parse_args()
# Thread counts must be fixed before NumPy (OpenBLAS) and torch start their pools.
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402

from kvlab.hf import load_model  # noqa: E402


def make_checkpoint(folder: Path) -> None:
    """Seeded random weights of the SmolLM2-135M shape, saved by transformers in float32 (once)."""
    if (folder / "model.safetensors").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"writing {folder} ...", file=sys.stderr)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"]))
    with torch.no_grad():  # weights of realistic scale, so softmax and argmax are not degenerate
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)


def measure_bandwidth(repeats: int = 7) -> float:
    """Read bandwidth (bytes/s) of a 512 MiB float32 sgemv: the kernel a decode step spends its time in."""
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((8192, 16384), dtype=np.float32)
    vector = rng.standard_normal(8192, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        vector @ matrix
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best


def gemv_floor(model, repeats: int = 5) -> float:
    """Seconds for one decode step's matrix-vector products alone (four per layer and the LM head), on the
    model's own weights as kvlab lays them out: what NumPy/OpenBLAS achieves for the weight reads with no
    other work in between. The gap from here to the roofline is the BLAS kernels on small cold matrices;
    the gap from kvlab to here is everything else a step does (norms, RoPE, attention, Python)."""
    c = model.config
    h = np.ones((1, c.hidden_size), model.dtype)
    attn = np.ones((1, c.num_attention_heads * c.head_dim), model.dtype)
    act = np.ones((1, c.intermediate_size), model.dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in model.layers:
            h @ layer.w_qkv
            attn @ layer.w_o
            h @ layer.w_gate_up
            act @ layer.w_down.T
        h @ model.lm_head
        best = min(best, time.perf_counter() - start)
    return best


def decode_bytes(model, context: int) -> int:
    """Bytes a decode step reads at `context`: all weights (tied head read once more as the head; the
    embedding row is negligible) plus K and V of every layer."""
    c = model.config
    per_layer = sum(getattr(layer, n).nbytes for layer in model.layers[:1]
                    for n in ("w_qkv", "w_o", "w_gate_up", "w_down", "input_norm", "post_norm"))
    weights = per_layer * c.num_hidden_layers + model.lm_head.nbytes + model.norm.nbytes
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * context * c.head_dim * model.dtype.itemsize
    return weights + kv


def kvlab_run(model, prompt: np.ndarray, steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode seconds per token) with kvlab's cache."""
    cache = model.new_cache(1, capacity=prompt.shape[1] + steps + 1)
    start = time.perf_counter()
    logits = model.forward(prompt, cache=cache, logits_to_keep=1).logits
    prefill = time.perf_counter() - start
    token = np.array([[int(np.argmax(logits[0, -1]))]])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model.forward(token, cache=cache, logits_to_keep=1).logits
        token[0, 0] = int(np.argmax(logits[0, -1]))
        times.append(time.perf_counter() - start)
    return prefill, statistics.median(times)


class _TokenClock:
    """A transformers streamer that only notes when each token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_run(ref, prompt: np.ndarray, steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode seconds per token) with transformers' generate and its DynamicCache."""
    import torch

    ids = torch.from_numpy(prompt)
    clock = _TokenClock()
    with torch.no_grad():
        start = time.perf_counter()
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                           pad_token_id=1, max_new_tokens=1 + steps, min_new_tokens=1 + steps, streamer=clock)
    assert out.shape[1] == prompt.shape[1] + 1 + steps and len(clock.times) == 2 + steps
    first = clock.times[1]  # the prompt is put at times[0], then one put per new token
    return first - start, statistics.median(np.diff(clock.times[1:]))


def main() -> None:
    make_checkpoint(ARGS.model_dir)
    model = load_model(ARGS.model_dir)
    ref = None
    if not ARGS.no_transformers:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(ARGS.threads)
        ref = AutoModelForCausalLM.from_pretrained(ARGS.model_dir, dtype=torch.float32).eval()
        ref.generation_config.eos_token_id = None
    bandwidth = measure_bandwidth()
    floor = float("inf")
    rng = np.random.default_rng(0)
    rows = []
    for context in ARGS.contexts:
        prompt = rng.integers(2, model.config.vocab_size, size=(1, context))
        best = {"kv_prefill": 1e9, "kv_decode": 1e9, "hf_prefill": 1e9, "hf_decode": 1e9}
        for _ in range(ARGS.repeats):  # alternate engines so drift hits both alike
            floor = min(floor, gemv_floor(model, repeats=3))
            bandwidth = max(bandwidth, measure_bandwidth(repeats=3))
            prefill, decode = kvlab_run(model, prompt, ARGS.steps)
            best["kv_prefill"], best["kv_decode"] = min(best["kv_prefill"], prefill), min(best["kv_decode"], decode)
            if ref is not None:
                prefill, decode = transformers_run(ref, prompt, ARGS.steps)
                best["hf_prefill"] = min(best["hf_prefill"], prefill)
                best["hf_decode"] = min(best["hf_decode"], decode)
        nbytes = decode_bytes(model, context)
        rows.append({"context": context, **best, "roofline": nbytes / bandwidth, "bytes": nbytes,
                     "gemv_floor": floor})

    print(f"SmolLM2-135M shape, random float32 weights ({ARGS.model_dir.name}); {ARGS.threads} threads; "
          f"measured sgemv read bandwidth {bandwidth / 1e9:.1f} GB/s; decode = median of {ARGS.steps} steps, "
          f"best of {ARGS.repeats} alternating rounds")
    header = (f"{'context':>7} | {'kvlab ms/tok':>12} {'HF ms/tok':>10} {'roofline':>9} {'gemv floor':>10} | "
              f"{'HF/kvlab':>8} {'kvlab/roof':>10} {'kvlab/floor':>11} | {'kvlab prefill tok/s':>19} "
              f"{'HF prefill tok/s':>16} {'kvlab/HF':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        has_hf = r["hf_decode"] < 1e9
        hf_decode = f"{1e3 * r['hf_decode']:10.2f}" if has_hf else f"{'-':>10}"
        speedup = f"{r['hf_decode'] / r['kv_decode']:7.2f}x" if has_hf else f"{'-':>8}"
        kv_rate, hf_rate = r["context"] / r["kv_prefill"], r["context"] / r["hf_prefill"]
        print(f"{r['context']:>7} | {1e3 * r['kv_decode']:12.2f} {hf_decode} {1e3 * r['roofline']:9.2f} "
              f"{1e3 * r['gemv_floor']:10.2f} | {speedup} {r['kv_decode'] / r['roofline']:9.2f}x "
              f"{r['kv_decode'] / r['gemv_floor']:10.2f}x | {kv_rate:19.0f} "
              + (f"{hf_rate:16.0f} {kv_rate / hf_rate:7.2f}x" if has_hf else f"{'-':>16} {'-':>8}"))
    print(f"roofline = bytes a step reads ({rows[0]['bytes'] / 1e6:.0f} MB + K/V) / measured bandwidth; gemv floor "
          "= the step's matrix-vector products alone, on kvlab's weights")
    OUT.mkdir(exist_ok=True)
    result = {"threads": ARGS.threads, "bandwidth_bytes_per_s": bandwidth, "rows": rows,
              "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE")}
    (OUT / "bench_hf_decode.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
