"""GGUF reading, side by side in one run: kvlab's header parser vs `gguf.GGUFReader`, and kvlab's chunked
dequantization vs `gguf.quants.dequantize` (what transformers' GGUF loading calls), per tensor type.

Writes one temporary file: a 50k-token vocabulary with 50k merges (like SmolLM's) and one 2048 x 2048
matrix per type. Every dequantized matrix is checked to be bit-identical to the reference. Times are the
best of `--repeats`; the machine may be shared, so read the ratios, not the absolute times.

    python bench/bench_gguf_load.py [--repeats 3] [--size 2048]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import os
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np

TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # Q2_K/Q3_K: same path


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def write_file(path: Path, size: int) -> None:
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    tokens = [f"tok{i}" for i in range(50000)]
    writer.add_token_list(tokens)
    writer.add_token_merges([f"t ok{i}" for i in range(50000)])
    for name in TYPES:
        kind = gguf.GGMLQuantizationType[name]
        if name.endswith("_K"):  # no K-quant quantizer in the gguf package: random blocks, sane f16 scales
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            data = rng.integers(0, 256, (size, size // block * type_size), dtype=np.uint8)
            scales = np.full((size, size // block), 1e-4, "<f2").view(np.uint8)
            view = data.reshape(size, size // block, type_size)
            if name == "Q6_K":
                view[..., -2:] = scales.reshape(size, -1, 2)
            else:
                view[..., :2] = scales.reshape(size, -1, 2)
                view[..., 2:4] = scales.reshape(size, -1, 2)
        else:
            data = gguf.quants.quantize(rng.standard_normal((size, size)).astype(np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=2048)
    args = parser.parse_args()

    import gguf

    from kvlab.gguf.reader import read_gguf
    from kvlab.gguf.tensors import dequantize

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.gguf"
        write_file(path, args.size)
        ours = best(lambda: read_gguf(path), args.repeats)
        theirs = best(lambda: gguf.GGUFReader(path), args.repeats)
        print(f"header with a 50k vocabulary + 50k merges: kvlab {ours * 1e3:.0f} ms, GGUFReader "
              f"{theirs * 1e3:.0f} ms ({theirs / ours:.1f}x)")
        file = read_gguf(path)
        print(f"{'type':6} {'kvlab ms':>9} {'gguf ms':>9} {'ratio':>6}  ({args.size}x{args.size} values)")
        for name in TYPES:
            info = file.tensors[name]
            kind = gguf.GGMLQuantizationType[name]
            raw = np.asarray(file.raw(name)).reshape(args.size, -1)
            assert np.array_equal(dequantize(file, info, np.dtype(np.float32)),
                                  gguf.quants.dequantize(raw, kind).reshape(info.shape))
            ours = best(lambda: dequantize(file, info, np.dtype(np.float32)), args.repeats)
            theirs = best(lambda: gguf.quants.dequantize(raw, kind), args.repeats)
            print(f"{name:6} {ours * 1e3:9.1f} {theirs * 1e3:9.1f} {theirs / ours:5.2f}x")
        del file


if __name__ == "__main__":
    main()
