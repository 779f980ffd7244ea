"""`kvlab.load("model.gguf")`: a GGUF file (or a folder holding one) as kvlab's model and tokenizer.

The same objects the HF loader returns (a LlamaModel, an HFTokenizer), through the same validation
(ModelConfig, check_weights), in the same order: header, config, tokenizer and every tensor's name, type
and shape are checked before a single block is dequantized, so a bad file raises a CheckpointError or
ConfigError naming the file and the key or tensor, and never yields a half-loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlab import validate
from kvlab.config import ModelConfig
from kvlab.errors import CheckpointError, ConfigError
from kvlab.gguf.config import config_from_metadata
from kvlab.gguf.reader import GGUFFile, read_gguf
from kvlab.gguf.tensors import read_weights, split_fused, weight_plan
from kvlab.gguf.tokenizer import tokenizer_from_metadata
from kvlab.progress import weight_progress
from kvlab.kernels import resolve_backend
from kvlab.model.act_quant import AUTO, check_load_activations, default_activations
from kvlab.model.heap import release_free_memory
from kvlab.model.llama import LlamaModel
from kvlab.model.quantized import QuantizedMatrix
from kvlab.tokenizer import HFTokenizer

def gguf_file(path: str | Path | None) -> Path | None:
    """The .gguf file `path` names (the file itself, or the one .gguf in a folder without config.json);
    None when `path` is not a GGUF model, so the caller treats it as an HF folder."""
    if path is None:
        return None
    path = Path(validate.path_text(path, "model path", error=CheckpointError)).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return path
    if path.is_file():
        with open(path, "rb") as handle:
            return path if handle.read(4) == b"GGUF" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise CheckpointError(f"{path}: holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                              "pass the one to load")
    return found[0] if found else None


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in kvlab's terms: config, HF-named float weights, tokenizer."""

    path: Path
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: HFTokenizer


def open_gguf(path: str | Path) -> tuple[GGUFFile, ModelConfig, HFTokenizer, dict]:
    """Parse and validate everything but the tensor payload: (file, config, tokenizer, weight plan)."""
    resolved = gguf_file(path)
    if resolved is None:
        raise CheckpointError(f"{path}: not a .gguf file or a folder holding one")
    gguf = read_gguf(resolved)
    config = config_from_metadata(gguf)
    tokenizer = tokenizer_from_metadata(gguf)
    plan = weight_plan(gguf, config)
    return gguf, config, tokenizer, plan


def read_checkpoint(path: str | Path, dtype: Any = "float32", progress: bool | None = None,
                    keep_stored: bool = False, activations: str = "float32") -> GGUFCheckpoint:
    """Config, weights (HF names and layout, as the family's checkpoints hold them: Phi-3's q/k/v and
    gate/up fused; dequantized, or with `keep_stored` as the file stores the matrices, in the layout the
    `activations` mode reads) and tokenizer."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ConfigError(f"compute dtype must be float32 or float64, got {dtype}")
    gguf, config, tokenizer, plan = open_gguf(path)
    with weight_progress(sum(info.nbytes for info in plan.values()), progress) as advance:
        weights = read_weights(gguf, config, plan, dtype, on_tensor=advance, keep_stored=keep_stored,
                               activations=activations)
    return GGUFCheckpoint(gguf.path, config, weights, tokenizer)


WEIGHTS_DTYPES = ("float32", "float64", "stored")


def load_gguf(path: str | Path, dtype: Any = "float32", progress: bool | None = None,
              backend: str | None = None, weights_dtype: str = "float32",
              activations: str | None = None) -> tuple[LlamaModel, HFTokenizer]:
    """(model, tokenizer) of a GGUF file, computing in float32 (or float64).

    weights_dtype "float32" (or the compute dtype's name) dequantizes every tensor: the reference; "stored"
    keeps each matrix as the file stores it (F16/BF16 half, block types as codes read by the quantized
    kernels: a Q4 file's decode step reads ~0.75 bytes a weight instead of 4), with float32 compute;
    `activations` ("float32" or "q8", LlamaModel's; None/"auto": q8 where block-type matrices are kept as
    stored on the compiled backend, act_quant.default_activations) is the mode the model is built in, and
    with weights kept as stored the layout each matrix is read into (a q8 model never holds the float
    layout whole)."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ConfigError(f"weights_dtype for a GGUF file must be one of {', '.join(WEIGHTS_DTYPES)}, "
                          f"got {weights_dtype!r}")
    keep = weights_dtype == "stored"
    if keep and np.dtype(dtype) != np.float32:
        raise ConfigError(f"weights kept as stored need float32 compute, not {np.dtype(dtype).name}")
    asked, backend_name = check_load_activations(activations), resolve_backend(backend)
    mode = default_activations(keep, backend_name) if asked == AUTO else asked  # "q8" read into the dot layout...
    layout = mode if keep and backend_name == "numba" else "float32"  # (NumPy reads the float layout)
    checkpoint = read_checkpoint(path, dtype, progress, keep_stored=keep, activations=layout)
    if asked == AUTO:  # ...unless no matrix stayed block-quantized (an F16 file) or scores are soft-capped
        quantized = any(isinstance(w, QuantizedMatrix) for w in checkpoint.weights.values())
        mode = default_activations(quantized, backend_name, checkpoint.config)
    model = LlamaModel(checkpoint.config, weights=split_fused(checkpoint.config, checkpoint.weights), dtype=dtype,
                       source=str(checkpoint.path), backend=backend, weights_dtype="auto" if keep else None,
                       activations=mode)
    tokenizer = checkpoint.tokenizer
    del checkpoint
    release_free_memory()  # the unpacking's temporaries: freed, but held by malloc until trimmed
    return model, tokenizer
