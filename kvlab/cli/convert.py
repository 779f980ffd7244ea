"""`kvlab convert MODEL.gguf OUT_DIR`: a GGUF file as a Hugging Face folder the rest of the ecosystem reads.

Writes exactly what kvlab read: config.json, model.safetensors (the dequantized weights, HF names and row
order), tokenizer.json (the tokenizer built from the GGUF vocabulary), tokenizer_config.json (special
tokens, add_bos_token), chat_template.jinja and generation_config.json (eos ids and the recommended
sampling, if the file has any). Everything is read and checked first and written into a temporary folder
that is renamed into place, so a bad file or a failed write leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kvlab.cli.fmt import human_bytes
from kvlab.errors import InputError

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file to a Hugging Face model folder",
                       description="Dequantize a GGUF file (llama, mistral, qwen2, qwen3, smollm3, phi3, gemma2, "
                                   "gemma3) into an HF folder: config.json, model.safetensors, tokenizer.json, "
                                   "chat template.")
    p.add_argument("source", metavar="MODEL.gguf", help="the GGUF file (or a folder holding one)")
    p.add_argument("output", metavar="OUT_DIR", help="the folder to create (must not exist, or be empty)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="weight dtype in model.safetensors (default float32: exactly what kvlab computes with)")
    p.set_defaults(run=run)


def tokenizer_json(tokenizer: Any) -> str:
    """tokenizer.json, with <bos> added by its post-processor when the GGUF says add_bos_token (as Llama 3's
    tokenizer.json does), so every reader of the folder adds it without a tokenizer_config.json flag."""
    from tokenizers import Tokenizer, processors

    if not tokenizer.add_bos_token or tokenizer.bos_token_id is None:
        return tokenizer.tokenizer.to_str()
    copy = Tokenizer.from_str(tokenizer.tokenizer.to_str())
    bos = copy.id_to_token(tokenizer.bos_token_id)
    copy.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tokenizer.bos_token_id)])
    return copy.to_str()


def hf_files(checkpoint: Any, sampling: Any, dtype: str = "float32") -> dict[str, Any]:
    """The JSON and text files of the folder, by name."""
    config, tokenizer = checkpoint.config, checkpoint.tokenizer

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.tokenizer.id_to_token(token_id)

    eos = list(tokenizer.eos_token_ids)
    files: dict[str, Any] = {
        "config.json": {**config.to_hf_dict(), "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
                        "pad_token_id": tokenizer.pad_token_id, "dtype": dtype},  # else a class default
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tokenizer.bos_token_id),
            "eos_token": text(tokenizer.eos_token_id), "pad_token": text(tokenizer.pad_token_id),
            "clean_up_tokenization_spaces": False},
        "generation_config.json": {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos or None,
                                   "pad_token_id": tokenizer.pad_token_id},
        "tokenizer.json": tokenizer_json(tokenizer),
    }
    if sampling is not None and sampling.values:
        files["generation_config.json"].update({"do_sample": sampling.values.get("temperature", 1) != 0,
                                                **sampling.values})
    if tokenizer.chat_template is not None:
        files["chat_template.jinja"] = tokenizer.chat_template.source
    return files


def convert(source: str | Path, output: str | Path, dtype: str = "float32") -> Path:
    """Write the HF folder for `source` at `output`; returns the folder."""
    from kvlab.gguf.loader import gguf_file, read_checkpoint
    from kvlab.loader import model_sampling
    from kvlab.hf.safetensors import save_file

    output = Path(output).expanduser()
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise InputError(f"{output}: already exists and is not an empty folder (kvlab convert never overwrites)")
    if gguf_file(source) is None:
        raise InputError(f"{source}: not a .gguf file or a folder holding one")
    checkpoint = read_checkpoint(source, "float32")
    files = hf_files(checkpoint, model_sampling(source), dtype)
    weights = {name: array.astype(DTYPES[dtype]) for name, array in checkpoint.weights.items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
        for name, body in files.items():
            content = body if isinstance(body, str) else json.dumps(body, indent=2, ensure_ascii=False) + "\n"
            (staging / name).write_text(content, encoding="utf-8")
        if output.exists():
            output.rmdir()
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def run(args: argparse.Namespace) -> int:
    folder = convert(args.source, args.output, args.dtype)
    size = (folder / "model.safetensors").stat().st_size
    print(f"wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))} "
          f"({human_bytes(size)} of {args.dtype} weights)", file=sys.stderr)
    return 0
