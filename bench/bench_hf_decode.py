"""kvlab (NumPy reference and compiled kernels, float32 and bfloat16 weights) vs transformers, one run.

A random model of SmolLM2-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads / 3 KV heads,
vocab 49152, tied embeddings) is saved by transformers in float32 and in bfloat16 to bench/out/ (once)
and loaded by every engine. Side by side, alternating engines round by round so drift hits all alike:

  * decode ms/token at each context (median step, best round) and prefill time of that context's prompt;
  * the roofline: bytes a step must read (weights as stored + the K/V cache at that context) divided by
    the streaming-read bandwidth measured in the same round (a parallel sum over 512 MiB, not a gemv);
  * batched decode (batch 1/4/16 at 128 context): tokens/s and the ratio to batch 1;
  * a busy neighbour: a busy loop on one core beside the compiled decode, with 1 and 2 numba threads;
  * numba's first-run compile time (a cold cache directory) and a warm start, in subprocesses;
  * prefill against the compute roofline: the model's multiply-adds over the float32 GEMM rate NumPy's
    BLAS reaches in the same round (a 2048x2048 product), since a prefill is bound by arithmetic.

llama.cpp runs when llama-cpp-python imports (`pip install -e ".[bench]"`: PyPI has only the source
here, which builds in ~15 minutes on two cores): the same weights written by the `gguf` package as F32
and F16 files (Q/K rows permuted as llama.cpp's converter does, a placeholder vocabulary), driven from a
worker process (its OpenMP runtime stays apart from numba's) with the same thread count, alternating
with the other engines round by round. It keeps its own OpenMP wait policy unless one is set outside.

    python bench/bench_hf_decode.py [--threads 2] [--contexts 128 1024 4096] [--batches 1 4 16] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import os
import importlib.metadata
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
from shapes import SMOLLM2_135M  # noqa: E402 (bench/shapes.py)

SHAPE = SMOLLM2_135M


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per context and engine")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds; the best round is reported")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-busy", action="store_true", help="skip the busy-neighbour round")
    p.add_argument("--no-compile-time", action="store_true", help="skip the cold/warm compile subprocesses")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even if llama-cpp-python imports")
    p.add_argument("--kv-dtypes", nargs="*", default=[],
                   help="also run the compiled engines with these cache dtypes (int8, fp8_e4m3, bfloat16, ...)")
    return p.parse_args()


ARGS = parse_args()
# Thread counts must be fixed before NumPy (OpenBLAS), numba and torch start their pools. Every engine
# gets the same OpenMP wait policy (kvlab's default, see kvlab/kernels/__init__.py), llama.cpp excepted.
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
OUTSIDE_WAIT_POLICY = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's own default (kvlab/__init__.py), before NumPy

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvlab, not an installed one
from kvlab.hf import load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_peer  # noqa: E402
from kvlab_timing import kvlab_run  # noqa: E402 (bench/kvlab_timing.py)
from roofline import measure_bandwidth  # noqa: E402 (bench/roofline.py)


def make_checkpoints(f32: Path, bf16: Path) -> None:
    """Seeded random weights of the SmolLM2-135M shape, saved by transformers in float32 and bfloat16."""
    def current(folder: Path) -> bool:
        config = folder / "config.json"
        return (folder / "model.safetensors").is_file() and config.is_file() and \
            json.loads(config.read_text()).get("max_position_embeddings") == SHAPE["max_position_embeddings"]

    if current(f32) and current(bf16):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"writing {f32} and {bf16} ...", file=sys.stderr)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"]))
    with torch.no_grad():  # weights of realistic scale, so softmax and argmax are not degenerate
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(f32)
    model.to(torch.bfloat16).save_pretrained(bf16)


def matrix_params(model) -> int:
    """Weights a decode step multiplies by: every block matrix and the LM head."""
    return sum(getattr(layer, n).size for layer in model.layers
               for n in ("w_qkv", "w_o", "w_gate_up", "w_down")) + model.lm_head.size


def step_bytes(model, context: int, weight_bytes: int, batch: int = 1, kv_dtype: str = "float32") -> float:
    """Bytes a decode step reads: every weight matrix once at `weight_bytes` each (the LM head included),
    plus the K/V cache of every sequence at `context` in `kv_dtype` (int8/int4 scales included)."""
    from kvlab.cache.dtypes import PAYLOAD_BYTES, scale_bytes_per_row, size_name

    c = model.config
    row = float(PAYLOAD_BYTES[size_name(kv_dtype)]) * c.head_dim + scale_bytes_per_row(kv_dtype, c.head_dim)
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * context * row * batch
    return matrix_params(model) * weight_bytes + kv


def prefill_flops(model, tokens: int) -> float:
    """Multiply-adds x 2 of a prefill with logits for the last token only: the block matrices for every
    token, causal attention (QK^T and PV over the visible half), and one LM-head row."""
    c = model.config
    blocks = matrix_params(model) - model.lm_head.size
    attention = 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * tokens * (tokens + 1) / 2
    return 2.0 * (blocks * tokens + attention + model.lm_head.size)


def measure_gemm_rate(repeats: int = 3) -> float:
    """float32 multiply-adds x 2 per second of NumPy's BLAS on a 2048-square product (the threads set above)."""
    a = np.ones((2048, 2048), dtype=np.float32)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * 2048 ** 3 / best


class _TokenClock:
    """A transformers streamer that only notes when each token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_run(ref, prompt: np.ndarray, steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode seconds per token) with transformers' generate and its cache."""
    import torch

    ids = torch.from_numpy(prompt)
    clock = _TokenClock()
    with torch.no_grad():
        start = time.perf_counter()
        ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                     pad_token_id=1, max_new_tokens=1 + steps, min_new_tokens=1 + steps, streamer=clock)
    return clock.times[1] - start, statistics.median(np.diff(clock.times[1:]))


def compile_times(model_dir: Path) -> dict[str, float]:
    """Seconds for a fresh process to load the bf16 model and run a prefill and a decode step, with an
    empty numba cache (the first run ever: compiles) and again (the cache on disk: loads)."""
    code = ("import time, numpy as np; t = time.perf_counter(); import kvlab\n"
            f"m = kvlab.hf.load_model({str(model_dir)!r}); c = m.new_cache()\n"
            "m.forward(np.arange(1, 20)[None], cache=c); m.forward([[3]], cache=c)\n"
            "print(time.perf_counter() - t)")
    result = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
        for name in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 check=True)
            result[name] = float(out.stdout.strip().splitlines()[-1])
    return result


def busy_neighbour(models: dict, prompt: np.ndarray, steps: int) -> list[dict]:
    """Decode ms/step quiet and with a busy loop beside it, for 1 and 2 numba threads."""
    import numba

    rows = []
    for busy in (False, True):
        proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            time.sleep(0.5 if busy else 0)
            for name, model in models.items():
                for threads in (1, ARGS.threads):
                    numba.set_num_threads(threads)
                    _, decode = kvlab_run(model, prompt, steps)
                    rows.append({"engine": name, "threads": threads, "busy": busy, "decode": decode})
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    numba.set_num_threads(ARGS.threads)
    return rows


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    f32_dir, bf16_dir = OUT / "smollm2-135m-shape-f32", OUT / "smollm2-135m-shape-bf16"
    make_checkpoints(f32_dir, bf16_dir)
    con = Console(stderr=True)
    compiled = {}
    if not ARGS.no_compile_time:
        compiled = compile_times(bf16_dir)
        con.print(f"numba compile: first run (cold cache) {compiled['cold']:.1f} s, later runs {compiled['warm']:.1f} s")
    engines = {"kvlab numpy f32": load_model(f32_dir, backend="numpy"),
               "kvlab compiled f32": load_model(f32_dir, backend="numba"),
               "kvlab compiled bf16": load_model(bf16_dir, backend="numba")}
    assert engines["kvlab compiled bf16"].weights_dtype.name == "bfloat16"
    cache_dtypes = {}  # engine name -> the cache dtype its rows use (kvlab's default: float32)
    for kv_dtype in ARGS.kv_dtypes:
        for name in ("kvlab compiled f32", "kvlab compiled bf16"):
            engines[f"{name} kv={kv_dtype}"] = engines[name]
            cache_dtypes[f"{name} kv={kv_dtype}"] = kv_dtype
    if not ARGS.no_transformers:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(ARGS.threads)
        for label, dtype in (("transformers f32", torch.float32), ("transformers bf16", torch.bfloat16)):
            ref = AutoModelForCausalLM.from_pretrained(f32_dir if dtype == torch.float32 else bf16_dir,
                                                       dtype=dtype).eval()
            ref.generation_config.eos_token_id = None
            engines[label] = ref
    llama_cpp_note = "skipped (--no-llama-cpp)" if ARGS.no_llama_cpp else llama_cpp_peer.available()
    if not llama_cpp_note:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update(OUTSIDE_WAIT_POLICY)
        for qtype in ("F32", "F16"):
            path = OUT / f"smollm2-135m-shape-{qtype.lower()}.gguf"
            llama_cpp_peer.write_gguf(f32_dir, path, qtype)
            engines[f"llama.cpp {qtype.lower()}"] = llama_cpp_peer.LlamaCppWorker(
                path, ARGS.threads, max(ARGS.contexts) + ARGS.steps + 8, env)
        llama_cpp_note = f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}"
    con.print(f"llama.cpp: {llama_cpp_note}")
    rng = np.random.default_rng(0)
    bandwidth = gemm_rate = 0.0
    results: dict[str, dict] = {}
    for context in ARGS.contexts:
        prompt = rng.integers(2, SHAPE["vocab_size"], size=(1, context))
        best = {name: [1e9, 1e9] for name in engines}
        for _ in range(ARGS.repeats):
            bandwidth = max(bandwidth, measure_bandwidth(3))
            gemm_rate = max(gemm_rate, measure_gemm_rate())
            for name, engine in engines.items():
                if name.startswith("transformers"):
                    prefill, decode = transformers_run(engine, prompt, ARGS.steps)
                elif name.startswith("llama.cpp"):
                    prefill, decode = engine.run(context, ARGS.steps)
                else:
                    prefill, decode = kvlab_run(engine, prompt, ARGS.steps, cache_dtypes.get(name))
                best[name] = [min(best[name][0], prefill), min(best[name][1], decode)]
        results[str(context)] = {name: {"prefill": p, "decode": d} for name, (p, d) in best.items()}
    llama_cpp_error = {}
    for name in cache_dtypes:  # the same model objects: not again in the batch, busy and logit checks
        engines.pop(name)
    check_ids = [int(t) for t in rng.integers(300, SHAPE["vocab_size"], size=16)]
    want = engines["kvlab compiled f32"].forward([check_ids]).logits[0, -1]
    for name, engine in engines.items():
        if name.startswith("llama.cpp"):
            llama_cpp_error[name] = float(np.abs(engine.last_logits(check_ids) - want).max())
            engine.close()
    if llama_cpp_error:
        con.print("same model in llama.cpp: max |logit difference| vs kvlab f32 after 16 tokens: "
                  + ", ".join(f"{n} {e:.2e}" for n, e in llama_cpp_error.items()))
    batch_rows = []
    prompt = rng.integers(2, SHAPE["vocab_size"], size=(max(ARGS.batches), 128))
    for name in ("kvlab compiled f32", "kvlab compiled bf16", "kvlab numpy f32"):
        for batch in ARGS.batches:
            decode = min(kvlab_run(engines[name], prompt[:batch], ARGS.steps)[1] for _ in range(ARGS.repeats))
            batch_rows.append({"engine": name, "batch": batch, "decode": decode, "tokens_per_s": batch / decode})
    busy_rows = [] if ARGS.no_busy else busy_neighbour(
        {n: engines[n] for n in ("kvlab compiled f32", "kvlab compiled bf16")}, prompt[:1], ARGS.steps)

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    load = os.getloadavg()[0]
    title = (f"SmolLM2-135M shape, random weights; {cpu}, {ARGS.threads} threads; streaming read "
             f"{bandwidth / 1e9:.1f} GB/s, float32 GEMM {gemm_rate / 1e9:.0f} GFLOP/s, both measured in the same "
             f"run; load average {load:.1f} (a shared machine: compare ratios, not absolute times)")
    table = Table(title=title)
    for column in ("context", "engine", "decode ms/tok", "x roofline", "HF f32 / engine", "prefill ms",
                   "prefill vs HF f32", "prefill x compute roofline"):
        table.add_column(column, justify="right" if column != "engine" else "left")
    rows = []
    reference = engines["kvlab compiled f32"]
    for context, by_engine in results.items():
        hf = by_engine.get("transformers f32")
        for name, r in by_engine.items():
            weight_bytes = 4 if name.split(" kv=")[0].endswith("f32") else 2
            roof = step_bytes(reference, int(context), weight_bytes, kv_dtype=cache_dtypes.get(name, "float32")) \
                / bandwidth
            compute_roof = prefill_flops(reference, int(context)) / gemm_rate
            row = {"context": int(context), "engine": name, **r, "roofline": roof,
                   "prefill_compute_roofline": compute_roof}
            rows.append(row)
            table.add_row(context, name, f"{1e3 * r['decode']:.2f}", f"{r['decode'] / roof:.2f}x",
                          f"{hf['decode'] / r['decode']:.2f}x" if hf else "-", f"{1e3 * r['prefill']:.0f}",
                          f"{hf['prefill'] / r['prefill']:.2f}x" if hf else "-",
                          f"{r['prefill'] / compute_roof:.2f}x")
    con.print(table)
    batch_table = Table(title="batched decode at 128 context (weights read once per step for the batch)")
    for column in ("engine", "batch", "ms/step", "tokens/s", "x batch 1"):
        batch_table.add_column(column)
    for r in batch_rows:
        one = next(b for b in batch_rows if b["engine"] == r["engine"] and b["batch"] == ARGS.batches[0])
        batch_table.add_row(r["engine"], str(r["batch"]), f"{1e3 * r['decode']:.2f}", f"{r['tokens_per_s']:.0f}",
                            f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x")
    con.print(batch_table)
    if busy_rows:
        busy_table = Table(title="busy neighbour: a busy loop on one core beside decode at 128 context")
        for column in ("engine", "numba threads", "quiet ms/tok", "busy ms/tok", "slowdown"):
            busy_table.add_column(column)
        for r in busy_rows:
            if r["busy"]:
                quiet = next(q for q in busy_rows if not q["busy"] and q["engine"] == r["engine"]
                             and q["threads"] == r["threads"])
                busy_table.add_row(r["engine"], str(r["threads"]), f"{1e3 * quiet['decode']:.2f}",
                                   f"{1e3 * r['decode']:.2f}", f"{r['decode'] / quiet['decode']:.2f}x")
        con.print(busy_table)
    OUT.mkdir(exist_ok=True)
    report = {"cpu": cpu, "threads": ARGS.threads, "load_average": load, "bandwidth_bytes_per_s": bandwidth,
              "gemm_flops_per_s": gemm_rate, "llama_cpp": llama_cpp_note, "llama_cpp_logit_error": llama_cpp_error,
              "compile_seconds": compiled, "rows": rows, "batches": batch_rows, "busy_neighbour": busy_rows,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
              "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
              "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}
    (OUT / "bench_hf_decode.json").write_text(json.dumps(report, indent=2))
    plot(rows, batch_rows, title)


def plot(rows: list[dict], batch_rows: list[dict], title: str) -> None:
    """bench/out/bench_hf_decode.png: decode ms/token per engine and context (roofline marked), and
    batched throughput."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["engine"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next(r["decode"] for r in rows if r["engine"] == name and r["context"] == c) * 1e3
                  for c in contexts]
        left.bar([j + i * width for j in range(len(contexts))], values, width, label=name)
    for j, c in enumerate(contexts):
        for name, style in (("kvlab compiled f32", "k--"), ("kvlab compiled bf16", "k:")):
            roof = next(r["roofline"] for r in rows if r["engine"] == name and r["context"] == c)
            left.plot([j - width / 2, j + 0.8], [roof * 1e3] * 2, style,
                      label=f"roofline ({name.split()[-1]} weights)" if j == 0 else None)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))], [f"context {c}" for c in contexts])
    left.set_ylabel("decode ms/token (lower is better)")
    left.legend(fontsize=8)
    for name in dict.fromkeys(r["engine"] for r in batch_rows):
        pts = [(r["batch"], r["tokens_per_s"]) for r in batch_rows if r["engine"] == name]
        right.plot(*zip(*pts), marker="o", label=name)
    right.set_xlabel("batch size")
    right.set_ylabel("decode tokens/s")
    right.set_xscale("log", base=2)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "bench_hf_decode.png", dpi=110)


if __name__ == "__main__":
    main()
