"""Load a Hugging Face model folder: config, safetensors weights (single or sharded), tokenizer.

`load(path)` returns `(LlamaModel, HFTokenizer)`. Everything that can be checked is checked before any
model exists: the config, every safetensors header against its file size, every tensor's name, shape and
dtype against the config, and the shard index against the shards. Only then is the payload read (memory
mapped, cast to the compute dtype tensor by tensor, with a progress bar on stderr for large models), so a
bad folder raises a CheckpointError or ConfigError naming the file and never yields a half-loaded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from kvlab import validate
from kvlab.config import ModelConfig
from kvlab.errors import CheckpointError, ConfigError
from kvlab.chat_template import ChatTemplate
from kvlab.progress import weight_progress
from kvlab.hf.fused import split_fused, stored_shapes
from kvlab.hf.safetensors import SafetensorsHeader, open_tensors, read_header
from kvlab.model.llama import LlamaModel
from kvlab.model.weights import HALF_DTYPES, IGNORED_SUFFIXES, expected_shapes, optional_shapes
from kvlab.tokenizer import HFTokenizer

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "shakespeare"
FLOAT_CODES = {"float32", "float16", "bfloat16", "float64"}


def resolve_model_dir(path: str | Path | None) -> Path:
    """The folder to load: `path`, or the default model shipped in the package."""
    if path is None:
        folder = DEFAULT_MODEL_DIR
        if not (folder / "config.json").is_file():
            raise CheckpointError(
                f"the default model is not available: {folder} has no config.json yet (it is produced by "
                "scripts/train_default_model.py); pass a model folder instead")
        return folder
    if isinstance(path, (str, Path)) and not Path(path).expanduser().exists() \
            and not Path(path).expanduser().is_symlink():
        raise CheckpointError(f"{Path(path).expanduser()}: no such model folder")
    return validate.existing_path(path, "model folder (with config.json and *.safetensors)", kind="dir",
                                  error=CheckpointError)


def read_json(path: Path, required: bool = True) -> dict[str, Any] | None:
    """A JSON object from `path`; None if it is absent and not required (a folder or a loop is refused)."""
    if not required and not path.exists() and not path.is_symlink():
        return None
    return validate.read_json_object(path, path.name, error=CheckpointError)


def load_config(folder: Path) -> ModelConfig:
    raw = read_json(folder / "config.json")
    return ModelConfig.from_hf_dict(raw, source=str(folder / "config.json"))


# --- weights ----------------------------------------------------------------------------------------------
def weight_headers(folder: Path) -> tuple[list[SafetensorsHeader], dict[str, Path], str]:
    """Validated headers of every weight file, which file holds each tensor, and a name for errors."""
    index_path = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        for name in files:
            if Path(name).name != name:
                raise CheckpointError(f"{index_path}: shard name {name!r} must be a file in the folder")
        headers = [read_header(folder / name) for name in files]
        by_file = {h.path.name: h for h in headers}
        for tensor, file in weight_map.items():
            if tensor not in by_file[file].tensors:
                raise CheckpointError(f"{folder / file}: tensor {tensor!r} is listed in {index_path.name} but "
                                      "missing from the file")
        source = str(index_path)
    elif single.is_file():
        headers, source = [read_header(single)], str(single)
    else:
        if list(folder.glob("*.bin")) or list(folder.glob("*.pt")) or list(folder.glob("*.pth")):
            raise CheckpointError(f"{folder}: only pickle-based weights (*.bin/*.pt); kvlab reads safetensors "
                                  "only (convert with transformers' save_pretrained(safe_serialization=True))")
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    location: dict[str, Path] = {}
    for header in headers:
        for name in header.tensors:
            if name in location:
                raise CheckpointError(f"{header.path}: tensor {name!r} also appears in {location[name]}")
            location[name] = header.path
    return headers, location, source


def check_headers(config: ModelConfig, headers: list[SafetensorsHeader], source: str) -> None:
    """Name, shape and dtype of every tensor against the config, naming the file that holds it (under the
    checkpoint's own names: Phi-3's fused matrices, kvlab/hf/fused.py)."""
    required, optional = stored_shapes(config, expected_shapes(config)), optional_shapes(config)
    present: set[str] = set()
    for header in headers:
        for name, info in header.tensors.items():
            want = required.get(name, optional.get(name))
            if want is None:
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                raise CheckpointError(f"{header.path}: unexpected tensor {name!r} for this config "
                                      f"({config.architecture})")
            if info.shape != want:
                raise CheckpointError(f"{header.path}: tensor {name!r} has shape {info.shape} but the config "
                                      f"implies {want}")
            if info.dtype.name not in FLOAT_CODES:
                raise CheckpointError(f"{header.path}: tensor {name!r} is {info.dtype.name}; weights must be "
                                      "float32, float16, bfloat16 or float64")
            present.add(name)
    missing = [name for name in required if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}{more}")


def read_weights(headers: list[SafetensorsHeader], dtype: np.dtype, progress: bool | None = None,
                 keep_half: bool = False) -> dict[str, np.ndarray]:
    """Every used tensor, copied out of its memory map into `dtype` (the model keeps its own arrays);
    with `keep_half`, float16/bfloat16 matrices stay as stored (weights_dtype="auto")."""
    total = sum(t.nbytes for h in headers for t in h.tensors.values())
    tensors: list[tuple[str, np.ndarray]] = []
    for header in headers:
        tensors += [(name, array) for name, array in open_tensors(header).items()
                    if not name.endswith(IGNORED_SUFFIXES)]
    weights: dict[str, np.ndarray] = {}

    def target(array: np.ndarray) -> np.dtype:
        half = array.ndim == 2 and array.dtype.name in HALF_DTYPES
        return array.dtype if keep_half and half else dtype

    with weight_progress(total, progress) as advance:
        for name, array in tensors:
            weights[name] = np.array(array, dtype=target(array))
            advance(array.nbytes)
    return weights


def load_model(path: str | Path | None = None, dtype: Any = "float32", progress: bool | None = None,
               weights_dtype: str = "auto", backend: str | None = None) -> LlamaModel:
    """The model of an HF folder (None: the default model), computing in float32 (or float64).

    weights_dtype "auto" keeps a float16/bfloat16 checkpoint's matrices as stored (half the bytes a decode
    step reads; the math stays float32); "float32" casts them. backend: None/"auto", "numba" or "numpy".
    A .gguf file is kvlab.loader's to choose (it calls kvlab/gguf/loader.py).
    """
    folder = resolve_model_dir(path)
    dtype = validate.compute_dtype(dtype, error=ConfigError)
    config = load_config(folder)
    headers, _, source = weight_headers(folder)
    check_headers(config, headers, source)
    if weights_dtype not in ("auto", "float32", "float64", "float16", "bfloat16"):
        raise ConfigError(f"weights_dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {weights_dtype!r}")
    weights = split_fused(config, read_weights(headers, dtype, progress, keep_half=weights_dtype != dtype.name))
    return LlamaModel(config, weights=weights, dtype=dtype, source=source,
                      weights_dtype=None if weights_dtype == dtype.name else weights_dtype, backend=backend)


# --- tokenizer --------------------------------------------------------------------------------------------
def _token_string(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def chat_template_source(folder: Path, tokenizer_config: Mapping[str, Any]) -> tuple[str | None, str]:
    """The template text and where it came from: chat_template.jinja overrides tokenizer_config.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return validate.read_text(jinja, jinja.name, error=CheckpointError), str(jinja)
    source = str(folder / "tokenizer_config.json")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{source}: chat_template must be a string")
    return template, source


def load_tokenizer(path: str | Path | None = None, config: ModelConfig | None = None) -> HFTokenizer:
    """The folder's tokenizer.json with its special tokens, eos ids and chat template."""
    from tokenizers import Tokenizer

    folder = resolve_model_dir(path)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(f"{tokenizer_file}: file not found (kvlab reads HF tokenizer.json files)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{tokenizer_file}: cannot be read by the tokenizers library ({exc})") from None
    tok_config = read_json(folder / "tokenizer_config.json", required=False) or {}
    gen_config = read_json(folder / "generation_config.json", required=False) or {}
    if config is None:
        model_config = read_json(folder / "config.json", required=False) or {}
    else:
        model_config = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}

    def token_id(field: str) -> int | None:
        text = _token_string(tok_config.get(field))
        if text is None:
            return None
        found = tokenizer.token_to_id(text)
        if found is None:
            raise CheckpointError(f"{folder / 'tokenizer_config.json'}: {field} {text!r} is not in "
                                  f"{tokenizer_file.name}")
        return found

    bos = token_id("bos_token")
    if bos is None:
        bos = next(iter(_id_list(gen_config.get("bos_token_id")) + _id_list(model_config.get("bos_token_id"))),
                   None)
    # Stop on every id any of the three files names: generation_config.json may list several (chat
    # models end turns with a token other than the document eos) or none at all, while
    # tokenizer_config.json names the eos token as text.
    eos = _id_list(gen_config.get("eos_token_id")) + _id_list(model_config.get("eos_token_id"))
    named_eos = token_id("eos_token")
    if named_eos is not None:
        eos.append(named_eos)
    add_bos = tok_config.get("add_bos_token")
    template, origin = chat_template_source(folder, tok_config)
    special = {"bos_token": _token_string(tok_config.get("bos_token")),
               "eos_token": _token_string(tok_config.get("eos_token")),
               "unk_token": _token_string(tok_config.get("unk_token")),
               "pad_token": _token_string(tok_config.get("pad_token"))}
    chat = ChatTemplate(template, special, origin) if template else None
    return HFTokenizer(tokenizer, bos_token_id=bos, eos_token_ids=eos,
                       add_bos_token=add_bos if isinstance(add_bos, bool) else None,
                       chat_template=chat, pad_token_id=token_id("pad_token"))


def load(path: str | Path | None = None, dtype: Any = "float32", progress: bool | None = None,
         weights_dtype: str = "auto", backend: str | None = None) -> tuple[LlamaModel, HFTokenizer]:
    """(model, tokenizer) of an HF folder; without a path, the default model shipped with kvlab.

    The tokenizer is read first (it is small), so a folder without one fails before the weights load.
    """
    folder = resolve_model_dir(path)
    config = load_config(folder)
    tokenizer = load_tokenizer(folder, config)
    return load_model(folder, dtype, progress, weights_dtype, backend), tokenizer
