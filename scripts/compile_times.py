"""Which numba compilations a cold cache pays for, per compiled function: a recorder around a workload.

CI starts with numba's on-disk cache empty, so every kernel specialisation a test touches is compiled
once (seconds each; an `inline="always"` helper is compiled again inside every caller). This runs a
workload in this process with NUMBA_CACHE_DIR pointed at a fresh empty folder (unless --warm) and prints
the wall time spent compiling each function, nested compilations counted in their callers too, so the
top rows say where a cold start goes:

    python scripts/compile_times.py --decode float32 q8_0 q4_0   # a small model per format: prefill + decode
    python scripts/compile_times.py -- tests/test_kernels.py -q  # any pytest selection
    python scripts/compile_times.py --top 40 --warm -- tests/test_engine.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", nargs="*", default=[], help="weight formats: float32, bfloat16, q8_0, q4_0, ...")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--warm", action="store_true", help="keep the usual numba cache (default: a fresh empty one)")
    return p.parse_args(argv), rest


ARGS, PYTEST_ARGS = parse_args()
if not ARGS.warm:
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvlab-cold-numba-")
sys.path.insert(0, str(ROOT))

from numba.core import event  # noqa: E402

totals: Counter[str] = Counter()
counts: Counter[str] = Counter()
_starts: dict[tuple[int, str], float] = {}


class Recorder(event.Listener):
    def on_start(self, ev: event.Event) -> None:
        _starts[id(ev.data["dispatcher"]), str(ev.data["args"])] = time.perf_counter()

    def on_end(self, ev: event.Event) -> None:
        start = _starts.pop((id(ev.data["dispatcher"]), str(ev.data["args"])), None)
        if start is None:
            return
        fn = ev.data["dispatcher"].py_func
        name = f"{fn.__module__}.{fn.__qualname__}"
        totals[name] += time.perf_counter() - start
        counts[name] += 1


def decode(formats: list[str]) -> None:
    """A prefill of 20 tokens and 3 decode steps per format, on a 2-layer model whose head dim (64) and
    GQA group (3) are SmolLM2-135M's: the kernels' specialisations depend on types and layouts, not sizes."""
    import numpy as np

    from kvlab import LlamaModel
    from kvlab.config import ModelConfig
    from kvlab.model.quantized import quantize_weights
    from kvlab.model.weights import random_weights

    config = ModelConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256)
    weights = random_weights(config, 0, np.float32)
    for name in formats:
        start = time.perf_counter()
        if name in ("float32", "bfloat16"):
            model = LlamaModel(config, weights, dtype=np.float32, weights_dtype=name)
        else:
            model = LlamaModel(config, quantize_weights(weights, name), dtype=np.float32)
        cache = model.new_cache(1)
        model.forward(np.arange(20)[None], cache=cache)
        for _ in range(3):
            model.forward(np.ones((1, 1), dtype=np.int64), cache=cache)
        print(f"{name}: first prefill + decode {time.perf_counter() - start:.1f} s")


def main() -> int:
    event.register("numba:compile", Recorder())
    start = time.perf_counter()
    code = 0
    if ARGS.decode:
        decode(ARGS.decode)
    if PYTEST_ARGS:
        import pytest
        code = int(pytest.main(PYTEST_ARGS))
    wall = time.perf_counter() - start
    cache = "the usual numba cache" if ARGS.warm else f"a cold numba cache ({os.environ['NUMBA_CACHE_DIR']})"
    print(f"\nnumba compile time by function, {cache}; {wall:.1f} s wall in all "
          f"(nested compilations are counted in their callers too)")
    for name, seconds in totals.most_common(ARGS.top):
        print(f"{seconds:8.1f} s {counts[name]:4d}x  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
