"""Decode and prefill with the weights as stored: float32, bfloat16, and GGUF block types (Q8_0, Q4_0, ...).

A random model of SmolLM2-135M's shape (hidden 576, 30 layers, 9/3 heads, vocab 49152, tied embeddings)
in float32; each format is that model's weights converted (bfloat16 rounded; block types quantized with
llama.cpp's encoder, kept as codes/scales/offsets and read by kernels/qgemv.py). All formats run side by
side in one process, alternating round by round, 2 threads:

  * decode ms/token at a 128-token context (median step of the best round) and tokens/s;
  * the roofline: the bytes a step reads (weights as kvlab keeps them + the K/V at that context) over the
    streaming-read bandwidth measured in the same run (a parallel sum over 512 MiB);
  * prefill of 128 tokens;
  * batched decode (--batch sequences, default 16, one step for all): tokens/s and its ratio to batch 1;
  * logits error against the float32 model of the same (dequantized) values: the kernels' summation order.

    python bench/bench_weight_formats.py [--formats float32 bfloat16 q8_0 q4_0 q4_1] [--steps 16] [--repeats 3]
        [--batch 16]

A block type with "+q8" ("q8_0+q8") rounds the products' inputs to int8 (`activations="q8"`, integer dot
products, kernels/qdot.py); its err/scale column is then that rounding's error, not summation order.

llama.cpp on the same files is not run here yet (the issue's bench); llama-cpp-python builds from source in
~15 minutes on two cores (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np  # noqa: E402

from kvlab import LlamaModel  # noqa: E402
from kvlab.config import ModelConfig  # noqa: E402
from kvlab.model.quantized import QuantizedMatrix, RowStack, dequantized, quantize_weights  # noqa: E402
from kvlab.model.weights import random_weights  # noqa: E402
from kvlab.progress import compiling_kernels  # noqa: E402
from roofline import measure_bandwidth  # noqa: E402 (bench/roofline.py)

from shapes import SMOLLM2_135M, models_in_formats  # noqa: E402 (bench/shapes.py)

SHAPE = SMOLLM2_135M


def step_bytes(model: LlamaModel, context: int) -> int:
    """Bytes a decode step reads: every block matrix and the LM head as kept, plus the K/V at `context`."""
    def size(w) -> int:
        return w.nbytes if isinstance(w, (QuantizedMatrix, RowStack)) else np.asarray(w).nbytes
    c = model.config
    weights = sum(size(layer.w_qkv) + size(layer.w_o) + size(layer.w_gate_up) + size(layer.w_down)
                  for layer in model.layers) + size(model.lm_head)
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * 4
    return weights + kv


def decode_ms(model: LlamaModel, prompt: np.ndarray, steps: int) -> tuple[float, float, float]:
    """(median decode ms/step, median process CPU ms/step, prefill ms) after a prefill of `prompt`
    ([B, T]: B sequences decoded together). CPU time (both threads) is the steadier figure when other
    processes hold the cores: it leaves out the time this process waited for one."""
    cache = model.new_cache(prompt.shape[0], capacity=prompt.shape[1] + steps + 1)
    start = time.perf_counter()
    model.forward(prompt, cache=cache, logits_to_keep=1)
    prefill = time.perf_counter() - start
    token = np.ones((prompt.shape[0], 1), dtype=np.int64)
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        model.forward(token, cache=cache)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return 1e3 * statistics.median(times), 1e3 * statistics.median(cpu), 1e3 * prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "q8_0", "q4_1", "q4_0"])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="also decode this many sequences together (0: skip)")
    p.add_argument("--batch-context", type=int, default=32, help="their context (a short prefill: 16 x 128 "
                   "tokens of prefill per format and round would dominate the run)")
    args = p.parse_args()
    config = ModelConfig(**SHAPE)
    weights = random_weights(config, 0, np.float32)  # the same seed as models_in_formats: the reference values
    models = models_in_formats(args.formats)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, size=(1, args.context))
    check = prompt[:, :16]
    errors = {}
    with compiling_kernels():  # first run only: said, and never inside a timed step
        for model in models.values():
            model.warm_up()
    for name, model in models.items():  # warm up and check against the same values in float32
        values = LlamaModel(config, dequantized(quantize_weights(weights, name.partition("+")[0])),
                            dtype=np.float32) if name not in ("float32", "bfloat16") else None
        got = model.forward(check).logits
        want = values.forward(check).logits if values is not None else got
        errors[name] = float(np.abs(got - want).max()) / (float(np.abs(want).max()) + 1)
        decode_ms(model, prompt[:, :4], 2)
        if args.batch:
            decode_ms(model, np.repeat(prompt[:, :4], args.batch, axis=0), 2)
    inf = float("inf")
    best = {name: [inf] * 5 for name in models}  # decode ms, cpu ms, prefill ms, batch ms, batch cpu ms
    bandwidth = 0.0
    batch_prompt = np.repeat(prompt[:, :args.batch_context], args.batch, axis=0)
    for _ in range(args.repeats):
        bandwidth = max(bandwidth, measure_bandwidth(3))
        for name, model in models.items():
            got = list(decode_ms(model, prompt, args.steps))
            got += list(decode_ms(model, batch_prompt, args.steps)[:2]) if args.batch else [inf, inf]
            best[name] = [min(a, b) for a, b in zip(best[name], got)]
    print(f"streaming read {bandwidth / 1e9:.1f} GB/s; context {args.context}; 2 threads; best of {args.repeats} "
          f"rounds of the median of {args.steps} steps; cpu = process CPU time per step (both threads); "
          f"batch {args.batch} at context {args.batch_context}")
    print(f"{'weights':<11}{'MB/step':>9}{'decode ms':>11}{'cpu ms':>8}{'tok/s':>8}{'x roofline':>12}{'vs f32':>8}"
          f"{'cpu vs f32':>11}{'prefill ms':>12}{f'b{args.batch} tok/s':>11}{'b/b1':>7}{'err/scale':>11}")
    f32, f32_cpu = best.get("float32", [None, None])[:2]
    for name, model in models.items():
        ms, cpu, pre, batch_ms, _ = best[name]
        read = step_bytes(model, args.context)
        roof = 1e3 * read / bandwidth
        batch_rate = 1e3 * args.batch / batch_ms if args.batch else float("nan")
        print(f"{name:<11}{read / 1e6:>9.1f}{ms:>11.2f}{cpu:>8.2f}{1e3 / ms:>8.1f}{ms / roof:>11.2f}x"
              f"{(f32 / ms if f32 else float('nan')):>7.2f}x{(f32_cpu / cpu if f32_cpu else float('nan')):>10.2f}x"
              f"{pre:>12.1f}{batch_rate:>11.1f}{batch_rate * ms / 1e3:>6.2f}x{errors[name]:>11.1e}")


if __name__ == "__main__":
    main()
