"""`kvlab quantize SRC OUT.gguf --type q8_0`: a GGUF file of quantized weights, from an HF folder or a GGUF.

llama-quantize's job for the types kvlab encodes (Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, with llama.cpp's reference
encoders): matrices in the chosen type, norms and biases float32, the vocabulary, chat template and
hyperparameters as the source has them. The result loads in kvlab (`--model OUT.gguf` on every command)
and in llama.cpp. `kvlab fidelity --weights TYPES` says what each type costs in quality first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvlab.cli.fmt import human_bytes
from kvlab.errors import InputError
from kvlab.model.quantized import QUANTIZE_TYPES, quant_type


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a GGUF file with quantized weights (llama-quantize)",
                       description="Quantize the matrices of an HF model folder or a GGUF file into a new GGUF "
                                   "file: " + ", ".join(QUANTIZE_TYPES) + ".")
    p.add_argument("source", metavar="SRC", help="HF model folder, or a .gguf file (requantized)")
    p.add_argument("output", metavar="OUT.gguf", help="the GGUF file to write (replaced if it exists)")
    p.add_argument("--type", dest="type_name", required=True, metavar="TYPE",
                   help="ggml type of the matrices: " + ", ".join(QUANTIZE_TYPES))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlab.gguf.loader import gguf_file
    from kvlab.gguf.writer import quantize_gguf

    type_name = quant_type(args.type_name)
    source, out = Path(args.source), Path(args.output)
    if out.suffix != ".gguf":
        raise InputError(f"{out}: the output must be a .gguf file")
    if not source.exists():
        raise InputError(f"{source}: no such model folder or file")
    if out.exists() and out.resolve() == source.resolve():
        raise InputError(f"{out}: the output would overwrite the source")
    if gguf_file(source) is not None:
        count = quantize_gguf(gguf_file(source), out, type_name)
    elif source.is_dir():
        count = quantize_hf(source, out, type_name)
    else:
        raise InputError(f"{source}: not a .gguf file or an HF model folder")
    print(f"wrote {out}: {count} tensors, matrices {type_name}, {human_bytes(out.stat().st_size)} "
          f"(from {human_bytes(sum(f.stat().st_size for f in ([source] if source.is_file() else source.glob('*.safetensors'))))})",
          file=sys.stderr)
    return 0


def quantize_hf(folder: Path, out: Path, type_name: str) -> int:
    """An HF folder (read as kvlab reads it) written as a GGUF of `type_name` matrices."""
    import json

    from kvlab.gguf.writer import write_model
    from kvlab.hf.loader import load_tokenizer
    from kvlab.loader import read_float_weights

    config, weights = read_float_weights(folder)
    spec_path = folder / "tokenizer.json"
    if not spec_path.is_file():
        raise InputError(f"{folder}: no tokenizer.json to write as the GGUF vocabulary")
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    return write_model(out, config, weights, spec, load_tokenizer(folder, config), type_name, folder.name)
