"""Where a decode step's time goes, and what a second thread buys: per part of the step, 1 vs 2 threads.

A random model of SmolLM2-135M's shape in each `--formats` (as bench_weight_formats.py builds them:
float32, bfloat16, or GGUF block types kept as codes), or the GGUF/HF files given with `--model`. For
each model and thread count (numba.set_num_threads, alternating round by round in one process, so both
counts see the same minute of a shared machine):

  * decode tokens/s at `--context` and `--batch` sequences (mean step of the best round), and the ratio
    to the first thread count's;
  * the step split into its parts, timed by wrapping them (perf_counter around each call; the wrapping
    itself costs ~1 us a call, counted in "rest"): the fused qkv+RoPE calls, the fused output+MLP calls,
    attention (write K/V and attend), the LM head (the final norm + vocabulary product), and the rest
    (embedding, sampling-free Python of the layer loop, the wrappers);
  * the same step with each block in one call (kernels/decode_block.py), run right after the split one in
    every round: its best ms/step and the median of its per-round ratio to the three calls a layer;
  * the roofline of each part's bytes (its weights as kept; for attention the K/V it reads) at the
    streaming-read bandwidth measured in the same run (bench/roofline.py).

And with `--bands`, prefill's band scheme alone on one quantized matrix (the MLP's gate/up, 576 x 3072):
dequantize-then-BLAS (QuantizedMatrix.matmul_t) against BLAS on the float32 matrix, ns per weight.

    PYTHONPATH=. python bench/bench_decode_profile.py [--formats float32 q8_0 q4_0 q4_0+q8] [--model F.gguf[+q8] ...]
        [--context 128] [--batch 1] [--steps 16] [--repeats 3] [--bands]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvlab import LlamaModel  # noqa: E402
from kvlab.model import attention as attention_module  # noqa: E402
from kvlab.model.quantized import QuantizedMatrix, RowStack  # noqa: E402
from roofline import measure_bandwidth  # noqa: E402
from shapes import models_in_formats  # noqa: E402

PARTS = ("qkv+rope", "output+mlp", "attention", "lm head", "rest")


class PartTimer:
    """Accumulates perf_counter time per part while `active`; wraps bound methods of one model."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, owner: object, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.active:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        setattr(owner, name, timed)


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, (QuantizedMatrix, RowStack)) else np.asarray(w).nbytes


def part_bytes(model: LlamaModel, context: int, batch: int = 1) -> dict[str, int]:
    c = model.config
    return {"qkv+rope": sum(nbytes(layer.w_qkv) for layer in model.layers),
            "output+mlp": sum(nbytes(layer.w_o) + nbytes(layer.w_gate_up) + nbytes(layer.w_down)
                              for layer in model.layers),
            "attention": 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * batch
            * np.dtype(model.dtype).itemsize,
            "lm head": nbytes(model.lm_head)}


def instrument(model: LlamaModel, timer: PartTimer) -> None:
    """Time the model's parts: its Ops' two fused calls and norm_linear (the LM head in the compiled
    decode path), and every attention object's call (patched on the classes: one model per process
    section is timed at a time through `timer.active`)."""
    timer.wrap(model.ops, "qkv_rope", "qkv+rope")
    timer.wrap(model.ops, "output_mlp", "output+mlp")
    timer.wrap(model.ops, "norm_linear", "lm head")


def patch_attention(timers: list[PartTimer]) -> None:
    for cls in (attention_module.ContiguousAttention,):
        inner = cls.__call__

        def timed(self, *args, _inner=inner, **kwargs):
            live = [t for t in timers if t.active]
            start = time.perf_counter()
            try:
                return _inner(self, *args, **kwargs)
            finally:
                for t in live:
                    t.seconds["attention"] += time.perf_counter() - start
        cls.__call__ = timed


def decode_round(model: LlamaModel, prompt: np.ndarray, steps: int, timer: PartTimer,
                 fused: bool = False) -> tuple[float, dict]:
    """Mean step seconds over `steps` decode steps after a prefill of `prompt`, and the parts' seconds
    per step (means over the same steps, so the parts add up to the step). The parts are timed on the
    three calls a layer; `fused`: each block in one call (kernels/decode_block.py), whose parts cannot
    be told apart (all of it lands in 'rest')."""
    if hasattr(model.ops, "fuse_decode"):
        model.ops.fuse_decode = fused
    cache = model.new_cache(prompt.shape[0], capacity=prompt.shape[1] + steps + 1)
    model.forward(prompt, cache=cache, logits_to_keep=1)
    token = np.ones((prompt.shape[0], 1), dtype=np.int64)
    timer.seconds.clear()
    times = []
    timer.active = True
    for _ in range(steps):
        start = time.perf_counter()
        model.forward(token, cache=cache)
        times.append(time.perf_counter() - start)
    timer.active = False
    parts = {k: v / steps for k, v in timer.seconds.items()}
    parts["rest"] = sum(times) / steps - sum(parts.values())
    return sum(times) / steps, parts


def build(args: argparse.Namespace) -> dict[str, LlamaModel]:
    models = {}
    if args.model:
        import kvlab
        for path in args.model:  # "F.gguf+q8": the same file with int8 activations (`activations="q8"`)
            file, plus, activations = path.partition("+")
            models[Path(file).name + plus + activations], _ = kvlab.load(file, activations=activations or "float32")
        return models
    return models_in_formats(args.formats)


def bands(bandwidth: float, repeats: int) -> None:
    """Prefill's band scheme on one matrix: dequantize-then-BLAS against BLAS on float32, 128 rows."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3072, 576)).astype(np.float32)
    x = rng.standard_normal((128, 576)).astype(np.float32)
    print(f"\nprefill bands, 128 rows x (576 -> 3072), best of {repeats * 10} calls, each quantized call "
          f"beside a float32 BLAS call on the same shape")
    print(f"{'weights':<8}{'ms':>8}{'ns/weight':>11}{'float32 BLAS ms':>17}{'dequant ns/weight':>19}")
    wt = np.ascontiguousarray(w.T)
    for name in ("q8_0", "q4_0", "q4_1"):
        matrix = QuantizedMatrix.quantize(w, name.upper())
        matrix.matmul_t(x)
        best = plain = float("inf")
        for _ in range(repeats * 10):
            plain = min(plain, _timed(lambda: x @ wt))
            best = min(best, _timed(lambda: matrix.matmul_t(x)))
        print(f"{name:<8}{1e3 * best:>8.2f}{1e9 * best / w.size:>11.3f}{1e3 * plain:>17.2f}"
              f"{1e9 * (best - plain) / w.size:>19.3f}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "q8_0", "q4_0"])
    p.add_argument("--model", nargs="*", help="GGUF files or HF folders instead of random models")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (one step for all)")
    p.add_argument("--bands", action="store_true", help="also time prefill's band dequantization alone")
    args = p.parse_args()
    import numba

    models = build(args)
    timers = {name: PartTimer() for name in models}
    for name, model in models.items():
        instrument(model, timers[name])
    patch_attention(list(timers.values()))
    prompt = np.random.default_rng(0).integers(0, 1000, size=(args.batch, args.context))
    for name, model in models.items():  # compile outside the timed rounds
        decode_round(model, prompt[:, :4], 2, timers[name])
        decode_round(model, prompt[:, :4], 2, timers[name], fused=True)
    best: dict[tuple[str, int], tuple[float, dict]] = {}
    one_call: dict[tuple[str, int], float] = {}  # the step with each block in one call, best of the rounds
    ratios: dict[tuple[str, int], list[float]] = defaultdict(list)  # its time / the three calls', per round
    bandwidth = 0.0
    for _ in range(args.repeats):
        bandwidth = max(bandwidth, measure_bandwidth(3))
        for name, model in models.items():
            for threads in args.threads:
                numba.set_num_threads(threads)
                got = decode_round(model, prompt, args.steps, timers[name])
                if (name, threads) not in best or got[0] < best[(name, threads)][0]:
                    best[(name, threads)] = got
                fused = decode_round(model, prompt, args.steps, timers[name], fused=True)[0]
                one_call[(name, threads)] = min(one_call.get((name, threads), fused), fused)
                ratios[(name, threads)].append(fused / got[0])
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}; streaming read {bandwidth / 1e9:.1f} GB/s (2 threads, same run); batch {args.batch}, "
          f"context {args.context}; "
          f"best of {args.repeats} rounds of the mean of {args.steps} steps; thread counts alternate")
    print(f"{'model':<18}{'thr':>4}{'tok/s':>8}{'ms/step':>8}  " + "".join(f"{p:>17}" for p in PARTS)
          + f"{'vs 1 thread':>13}{'one call':>10}{'one/three':>11}")
    for name, model in models.items():
        roof = part_bytes(model, args.context, args.batch)
        for threads in args.threads:
            step, parts = best[(name, threads)]
            cells = []
            for part in PARTS:
                ms = 1e3 * parts.get(part, 0.0)
                cells.append(f"{ms:>7.2f} ({ms / (1e3 * roof[part] / bandwidth):>4.1f}x)" if part in roof
                             else f"{ms:>7.2f}        ")
            ratio = best[(name, args.threads[0])][0] / step
            fused = f"{1e3 * one_call[(name, threads)]:>10.2f}{statistics.median(ratios[(name, threads)]):>11.3f}"
            print(f"{name:<18}{threads:>4}{args.batch / step:>8.1f}{1e3 * step:>8.2f}  " + "".join(f"{c:>17}" for c in cells)
                  + f"{ratio:>12.2f}x" + fused)
    print("parts: ms per step (x its roofline: the part's bytes at the streaming read; with a batch the products "
          "are bound by FMAs, not bytes); 'rest' has no bytes")
    print("the parts are the three calls a layer makes unfused; 'one call': ms/step with each block in one call "
          "(kernels/decode_block.py; best round), 'one/three': the median of its per-round ratio to the three calls")
    if args.bands:
        bands(bandwidth, args.repeats)


if __name__ == "__main__":
    main()
