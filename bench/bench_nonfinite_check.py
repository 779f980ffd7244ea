"""What refusing NaN/inf weights costs a load: `kvlab.load` with and without the finiteness check.

Writes a random Llama folder (float32 or bfloat16 on disk, ~`--megabytes` of weights), then loads it
alternately with the check on and off (off = `weights.first_non_finite` replaced by a no-op, for this
measurement only), several rounds each, and prints the median times and their ratio. Also times the check
alone on the loaded tensors. The machine is shared: read the ratio, not the absolute times.

    python bench/bench_nonfinite_check.py [--megabytes 256] [--rounds 5] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))

    import ml_dtypes
    import numpy as np

    from kvlab.config import ModelConfig
    from kvlab.hf import loader
    from kvlab.hf.safetensors import save_file
    from kvlab.model import weights as weights_module

    hidden = 1024
    per_layer = 4 * hidden * hidden + 3 * hidden * 2816  # q, k, v, o (MHA) + gate, up, down
    layers = max(1, args.megabytes * 2**20 // 4 // per_layer)
    config = ModelConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
    disk = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
        shapes = weights_module.expected_shapes(config)
        save_file({name: (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(disk)
                   for name, shape in shapes.items()}, folder / "model.safetensors")
        size = (folder / "model.safetensors").stat().st_size
        real_check = weights_module.first_non_finite

        def load(check: bool) -> float:
            weights_module.first_non_finite = real_check if check else (lambda array: None)
            start = time.perf_counter()
            model = loader.load_model(folder, progress=False)
            seconds = time.perf_counter() - start
            weights_module.first_non_finite = real_check
            del model
            return seconds

        load(True)  # warm the page cache
        on, off = [], []
        for _ in range(args.rounds):
            on.append(load(True))
            off.append(load(False))
        arrays = [np.ones(shape, dtype=np.float32) for shape in shapes.values()]
        start = time.perf_counter()
        for array in arrays:
            real_check(array)
        check_alone = time.perf_counter() - start
    print(f"checkpoint: {layers} layers, {size / 2**20:.0f} MiB of {args.dtype} on disk, "
          f"loaded as float32 ({args.rounds} rounds, machine shared)")
    print(f"load with check    median {statistics.median(on):.3f} s")
    print(f"load without check median {statistics.median(off):.3f} s")
    print(f"ratio with/without: {statistics.median(on) / statistics.median(off):.3f}")
    print(f"the check alone over the float32 tensors: {check_alone:.3f} s "
          f"({sum(a.nbytes for a in arrays) / check_alone / 2**30:.1f} GiB/s)")


if __name__ == "__main__":
    main()
