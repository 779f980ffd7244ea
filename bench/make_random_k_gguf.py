"""A small random Llama GGUF whose every matrix is one K type (Q2_K..Q6_K), for memory and decode benches.

Neither the `gguf` package nor `kvlab quantize` encodes K types, and SmolLM2's 576 columns are no multiple of
256, so the K-type layouts' resident bytes and speed are measured on a file of random K blocks (the tests'
own writer, tests/gguf_files.write_gguf: random codes and sub-block scales, every matrix the one type,
norms float32). The default shape: hidden 1024, intermediate 2816, 8 layers, 8 heads, 4 KV heads, a
512-token byte-level vocabulary (74.7 MiB as Q6_K).

    python bench/make_random_k_gguf.py /tmp/m-q6_k.gguf [--type Q6_K] [--layers 8] [--hidden 1024]
    python bench/bench_memory.py /tmp/m-q6_k.gguf --modes float32 q8 --no-stages
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_files import K_QUANTS, small_config, write_gguf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--type", choices=K_QUANTS, default="Q6_K")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024, help="a multiple of 256 (the K types' block)")
    p.add_argument("--intermediate", type=int, default=2816, help="a multiple of 256")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.hidden % 256 or args.intermediate % 256:
        p.error("--hidden and --intermediate must be multiples of 256 (a K type's super-block)")
    config = small_config("llama", hidden_size=args.hidden, intermediate_size=args.intermediate,
                          num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=512, vocab_size=512)
    write_gguf(args.out, config, types=(args.type,), seed=args.seed, chat_template=None)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.2f} MiB, every matrix {args.type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
