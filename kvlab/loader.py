"""`kvlab.load(path)`: the one place that decides whether a path is an HF folder or a GGUF file.

Both loaders (kvlab/hf/loader.py, kvlab/gguf/loader.py) produce the same objects and never import each other;
everything that takes "a model path" (the API, every CLI command, `kvlab memory`, sampling defaults) asks
here, so `--model x.gguf` means the same thing everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvlab.config import ModelConfig
from kvlab.errors import ConfigError
from kvlab.gguf.loader import gguf_file, load_gguf
from kvlab.hf import generation_config, loader as hf
from kvlab.model.act_quant import AUTO, check_load_activations, default_activations
from kvlab.model.heap import release_free_memory
from kvlab.model.llama import LlamaModel
from kvlab.sampling.defaults import ModelSampling
from kvlab.tokenizer import HFTokenizer

# What kvlab computes in (and so, by default, caches K/V in) unless told otherwise: every command's --dtype.
DEFAULT_COMPUTE_DTYPE = "float32"


def load(path: str | Path | None = None, dtype: Any = DEFAULT_COMPUTE_DTYPE, progress: bool | None = None,
         weights_dtype: str = "auto", backend: str | None = None,
         activations: str | None = None) -> tuple[LlamaModel, HFTokenizer]:
    """`model, tokenizer = kvlab.load(path)`; without a path, the default model shipped with kvlab.

    `path` is an HF folder, a .gguf file or a folder holding one. The tokenizer is read first (it is
    small), so a folder without one fails before the weights load. `weights_dtype`: see `load_model`;
    `activations`: None/"auto" (int8 activations for block-quantized weights on the compiled backend,
    exact products otherwise: model/act_quant.default_activations), "float32" or "q8"
    (LlamaModel.set_activations).
    """
    check_load_activations(activations)  # a misspelt name fails before the weights load
    if gguf_file(path) is not None:
        model, tokenizer = load_gguf(path, dtype, progress, backend=backend,
                                     weights_dtype=_gguf_weights(weights_dtype, dtype), activations=activations)
    elif _quantize_to(weights_dtype) is not None:
        model, tokenizer = _quantized_at_load(path, dtype, backend, weights_dtype), hf.load_tokenizer(path)
    else:
        model, tokenizer = hf.load(path, dtype, progress, weights_dtype, backend)
    return _with_activations(model, activations), tokenizer


def load_model(path: str | Path | None = None, dtype: Any = DEFAULT_COMPUTE_DTYPE, progress: bool | None = None,
               weights_dtype: str = "auto", backend: str | None = None,
               activations: str | None = None) -> LlamaModel:
    """The model alone (no tokenizer is read).

    `weights_dtype`: for an HF folder "auto" keeps float16/bfloat16 matrices as stored, "float32" casts
    them, and a GGUF block type ("q8_0", "q4_0", ...) quantizes every matrix at load with llama.cpp's
    encoder; for a GGUF file "auto" (with float32 compute) and "stored" keep every matrix as the file
    stores it (block types read by the quantized kernels, F16/BF16 half), anything else ("float32", or
    "auto" with float64 compute) dequantizes it into the compute dtype: the reference. `activations`: as
    `load`."""
    check_load_activations(activations)
    if gguf_file(path) is not None:
        model = load_gguf(path, dtype, progress, backend=backend, weights_dtype=_gguf_weights(weights_dtype, dtype),
                          activations=activations)[0]
    elif _quantize_to(weights_dtype) is not None:
        model = _quantized_at_load(path, dtype, backend, weights_dtype)
    else:
        model = hf.load_model(path, dtype, progress, weights_dtype, backend)
    return _with_activations(model, activations)


def _with_activations(model: LlamaModel, activations: str | None) -> LlamaModel:
    """The model in the mode asked for, "auto" resolved for its weights (a GGUF load built it so already)."""
    mode = check_load_activations(activations)
    if mode == AUTO:
        mode = default_activations(model.quantized, model.backend, model.config)
    if mode != model.activations:
        model.set_activations(mode)
        if model.quantized:  # the layout the mode does not read was dropped: give its pages back
            release_free_memory()
    return model


def _gguf_weights(weights_dtype: str, dtype: Any) -> str:
    """A GGUF's weights: as stored by default (decode reads 3-5x fewer bytes than float32, and is faster:
    README's weight-format table), dequantized to the compute dtype when asked or when computing in float64
    (the quantized kernels compute in float32)."""
    if weights_dtype == "stored" or (weights_dtype == "auto" and np.dtype(dtype) == np.float32):
        return "stored"
    return np.dtype(dtype).name


def _quantize_to(weights_dtype: Any) -> str | None:
    from kvlab.model.quantized import QUANTIZE_TYPES

    return weights_dtype.upper() if isinstance(weights_dtype, str) and weights_dtype.lower() in QUANTIZE_TYPES \
        else None


def _quantized_at_load(path: str | Path | None, dtype: Any, backend: str | None, weights_dtype: str) -> LlamaModel:
    from kvlab.model.quantized import quantize_weights

    if np.dtype(dtype) != np.float32:
        raise ConfigError(f"{weights_dtype} weights need float32 compute, not {np.dtype(dtype).name}")
    config, weights = read_float_weights(path)
    return LlamaModel(config, weights=quantize_weights(weights, weights_dtype), dtype=np.float32, backend=backend,
                      source=str(hf.resolve_model_dir(path)), weights_dtype="auto")


def model_config(path: str | Path) -> ModelConfig:
    """The config of an HF config.json / folder, or of a GGUF file's metadata (no weights read)."""
    from kvlab.gguf.config import config_from_metadata
    from kvlab.gguf.reader import read_gguf

    found = gguf_file(path)
    return config_from_metadata(read_gguf(found)) if found is not None else ModelConfig.from_file(path)


def model_sampling(path: str | Path | None) -> ModelSampling | None:
    """The recommended sampling of the model at `path` (None: the default model), or None if it has none.
    A generation_config.json next to a .gguf file wins over its metadata."""
    from kvlab.gguf.sampling import from_metadata

    if path is None:
        return generation_config.from_json(hf.DEFAULT_MODEL_DIR / "generation_config.json")
    found = gguf_file(path)
    if found is None:
        return generation_config.from_json(Path(path).expanduser() / "generation_config.json")
    beside = generation_config.from_json(found.parent / "generation_config.json")
    return beside if beside is not None else from_metadata(found)


def read_float_weights(path: str | Path | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(config, float32 weights by HF name) of an HF folder or a GGUF file (dequantized); None: the default
    model. For tools that transform weights (kvlab quantize, kvlab fidelity --weights)."""
    from kvlab.gguf.loader import read_checkpoint

    if gguf_file(path) is not None:
        checkpoint = read_checkpoint(path, np.float32, progress=False)
        return checkpoint.config, dict(checkpoint.weights)
    folder = hf.resolve_model_dir(path)
    config = hf.load_config(folder)
    headers, _, source = hf.weight_headers(folder)
    hf.check_headers(config, headers, source)
    return config, hf.read_weights(headers, np.dtype(np.float32), False, keep_half=False)
