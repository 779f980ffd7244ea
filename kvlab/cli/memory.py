"""`kvlab memory`: analytic K/V cache bytes per token, for T tokens x B sequences, and what fits a budget."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from rich.table import Table

from kvlab import validate
from kvlab.cache.dtypes import FLOAT_NAMES
from kvlab.cache.kv_spec import (FullAttentionSpec, LayerSpecs, MambaSpec, SlidingWindowSpec, kv_specs,
                                 model_config_specs)
from kvlab.cache.memory import (DTYPE_BYTES, GroupBytes, cache_bytes, canonical_dtype, group_bytes,
                                specs_payload_bytes_per_token, specs_scale_bytes_per_token,
                                specs_tokens_in_budget)
from kvlab.cli.fmt import console, human_bytes
from kvlab.config import ModelConfig, tiny_config
from kvlab.errors import ConfigError, InputError
from kvlab.model.act_quant import AUTO, LOAD_CHOICES, default_activations
from kvlab.validate import int_in_range, parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="size the KV cache of a model",
                       description="K/V payload = 2 * layers * batch * kv_heads * tokens * head_dim * bytes, "
                       "per layer type (sliding windows hold their window, MLA one latent, Mamba and linear-"
                       "attention layers a constant state), from config.json alone: architectures kvlab "
                       "does not run are sized too (\"sizing only\").")
    p.add_argument("path", nargs="?", default=None, help="an HF config.json or model folder, or a .gguf file "
                   "(the same as --config)")
    p.add_argument("--config", "-m", "--model", dest="config",
                   help="an HF config.json, model folder or .gguf file; default: the tiny seed model")
    p.add_argument("--dtype", help="cache dtype: " + ", ".join(DTYPE_BYTES)
                   + " (default: what kvlab allocates: the compute dtype, float64 for the tiny model, float32 "
                   "for a model, as generate, chat and serve run it)")
    p.add_argument("--tokens", "-c", type=int, default=None, help="cached positions per sequence "
                   "(default: max_position_embeddings)")
    p.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    p.add_argument("--state-dtype", help="dtype of the constant per-sequence states (Mamba, linear attention): "
                   "default the cache dtype when it is a float dtype, else the model's dtype (vLLM's "
                   "mamba_cache_dtype auto)")
    p.add_argument("--budget", help="memory for the cache, e.g. 8GiB or 1000000: how many tokens fit")
    p.add_argument("--activations", choices=LOAD_CHOICES, default="auto",
                   help="a .gguf model's products, as generate --activations runs them: the predicted peak "
                   "counts the weights in that mode's layout (default auto: q8 where the file has block-type "
                   "matrices, as generate runs it)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def _default_dtype(path: str | None, model: SizedModel) -> str:
    """The cache dtype kvlab itself allocates for the model at `path`: the compute dtype, as generate, chat
    and serve use it (K/V are cached in the dtype the model computes in unless --kv-cache-dtype says
    otherwise). The tiny seed model computes in float64; every loaded model in kvlab.loader's default,
    float32, whatever dtype its checkpoint stores (a float16 or bfloat16 checkpoint still computes in
    float32). A model kvlab does not run is sized in its own dtype (vLLM's kv_cache_dtype "auto"),
    bfloat16 when its config names none."""
    from kvlab.loader import DEFAULT_COMPUTE_DTYPE  # lazily: `kvlab memory` loads no model code otherwise

    if model.sizing_only is not None:
        return _own_dtype(model)
    return "float64" if path is None else DEFAULT_COMPUTE_DTYPE  # TinyLlama (chat --tiny) computes in float64


def _own_dtype(model: SizedModel) -> str:
    """The float dtype a config.json names for its weights ("bfloat16"), bfloat16 when it names none."""
    try:
        own = canonical_dtype(model.dtype) if model.dtype else "bfloat16"
    except InputError:
        own = "bfloat16"
    return own if own in FLOAT_NAMES else "bfloat16"


def gguf_weight_bytes(path: str) -> dict[str, int] | None:
    """Resident weight bytes of a GGUF file's tensors, from its directory alone: kept as stored (what
    `kvlab.load` keeps: block types unpacked as codes + float32 scales/offsets (a K type's factored),
    F16/BF16 half, the rest float32), the same with `activations="q8"` (the integer kernels' layout
    instead: the file's own bytes for the float16-scale types), dequantized to float32 (`weights_dtype="float32"`), the file's tensor
    bytes, and the largest tensor as stored (what a load holds twice for a moment). None for an HF model."""
    from kvlab.gguf.loader import gguf_file
    from kvlab.gguf.reader import read_gguf
    from kvlab.model.ggml_quants import BLOCK_SIZES
    from kvlab.model.quantized import predicted_bytes

    found = gguf_file(path)
    if found is None:
        return None
    stored = q8 = float32 = file = largest = blocks = 0
    for info in read_gguf(found).tensors.values():
        count = 1
        for size in info.shape:
            count *= size
        float32 += 4 * count
        file += info.nbytes
        if len(info.shape) == 2 and info.type_name in BLOCK_SIZES:
            kept, kept_q8 = (predicted_bytes(info.type_name, info.shape, mode) for mode in ("float32", "q8"))
            blocks += 1
        else:
            kept = kept_q8 = count * (2 if len(info.shape) == 2 and info.type_name in ("F16", "BF16") else 4)
        stored, q8, largest = stored + kept, q8 + kept_q8, max(largest, kept)
    return {"weights_stored": stored, "weights_stored_q8": q8, "weights_float32": float32, "file_tensors": file,
            "largest_stored": largest, "block_matrices": blocks}


# What a `kvlab generate` process holds besides weights and K/V, measured (bench/bench_memory.py, a 1B-shaped
# Q4_0 and Q8_0 file, Python 3.11, NumPy 2, numba 0.6x, AMD EPYC, 2026-12-05): the interpreter, NumPy,
# numba and the loaded kernels, the tokenizer (~150 MiB once loaded), then the kernels' warm-up and the
# step buffers (195-230 MiB in all while generating). While loading, the largest tensor is held about
# 1.25 times more (its unpacking temporaries in the float layout), beside the matrices read so far.
RUNTIME_LOAD_BYTES = 150 << 20
RUNTIME_RUN_BYTES = 235 << 20
LOAD_TRANSIENT = 1.25


def predicted_peak(weights: dict[str, int], kv_bytes: int, activations: str = "float32") -> dict[str, int]:
    """The peak RSS of a process that loads the file and runs `kv_bytes` of K/V: the larger of the load
    (the weights in the mode's layout + the largest tensor's temporaries + the runtime so far) and the run
    (the weights + K/V + the runtime), each part named."""
    resident = weights["weights_stored_q8" if activations == "q8" else "weights_stored"]
    load = resident + int(LOAD_TRANSIENT * weights["largest_stored"]) + RUNTIME_LOAD_BYTES
    run = resident + kv_bytes + RUNTIME_RUN_BYTES
    return {"weights": resident, "kv": kv_bytes, "runtime": RUNTIME_RUN_BYTES, "load_peak": load, "run_peak": run,
            "peak": max(load, run)}


@dataclass(frozen=True)
class SizedModel:
    """What `kvlab memory` sizes: the layer specs of a model, and whether kvlab runs it."""

    name: str
    architecture: str
    layer_specs: LayerSpecs
    max_position_embeddings: int | None
    sizing_only: str | None  # why kvlab does not run it; None when it does
    dtype: str | None        # the checkpoint's dtype as config.json names it, if it does


def sized_model(path: str | None) -> SizedModel:
    """The tiny seed model, a GGUF file's metadata, or an HF config.json / folder. A config kvlab refuses
    as not supported (architecture, feature) is still sized from its fields ("sizing only"); one it
    refuses as invalid (a bad value) is refused here too."""
    from kvlab.gguf.loader import gguf_file
    from kvlab.loader import model_config

    if path is None or gguf_file(path) is not None:
        config = tiny_config() if path is None else model_config(path)
        return SizedModel(path or "tiny (seed model)", config.architecture, model_config_specs(config),
                          config.max_position_embeddings, None, None)
    file = validate.existing_path(path, "config file or model folder", kind="any", error=ConfigError)
    if file.is_dir():
        file = file / "config.json"
    raw = validate.read_json_object(file, "config file", error=ConfigError)
    try:
        ModelConfig.from_hf_dict(raw, source=str(file))
        reason = None
    except ConfigError as exc:
        if "not supported" not in str(exc):
            raise
        reason = str(exc).removeprefix(f"{file}: ").split("; supported:")[0]
    layer_specs = kv_specs(raw, source=str(file))
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else \
        str(raw.get("model_type", "unknown"))
    positions = text.get("max_position_embeddings")
    positions = None if positions is None else validate.int_in_range(
        positions, f"{file}: max_position_embeddings", 1, error=ConfigError)
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    return SizedModel(path, arch, layer_specs, positions, reason, dtype if isinstance(dtype, str) else None)


def _default_state_dtype(dtype: str, model: SizedModel) -> str:
    """States are not quantized like K/V rows: they follow a float cache dtype, else the model's dtype."""
    return dtype if dtype in FLOAT_NAMES else _own_dtype(model)


def _number(value: Fraction | int) -> int | float:
    value = Fraction(value)
    return int(value) if value.denominator == 1 else float(value)


def _group_json(row: GroupBytes, state_dtype: str, batch: int) -> dict[str, Any]:
    spec, count = row.group.spec, len(row.group.layers)
    attention = isinstance(spec, FullAttentionSpec)
    return {"type": spec.kind, "label": spec.label, "layers": list(row.group.layers), "num_layers": count,
            "num_kv_heads": spec.num_kv_heads if attention else None,
            "head_size": spec.head_size if attention else None,
            "sliding_window": spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
            "state_shapes": [list(shape) for shape in spec.shapes] if isinstance(spec, MambaSpec) else None,
            "bytes_per_token_per_layer": _number(row.payload_bytes_per_token / count),
            "bytes_per_token": _number(row.payload_bytes_per_token),
            "scale_bytes_per_token": row.scale_bytes_per_token, "tokens_held": row.tokens_held,
            "kv_bytes": _number(row.kv_bytes),
            "state_bytes_per_sequence": count * spec.state_bytes(state_dtype),
            "state_bytes": row.state_bytes, "total_bytes": _number(row.total_bytes)}


def _uniform_full(layer_specs: LayerSpecs) -> FullAttentionSpec | None:
    """The one spec of a model whose every layer holds every token with the same shape, else None."""
    first = layer_specs[0] if layer_specs else ()
    if len(first) != 1 or type(first[0]) is not FullAttentionSpec:
        return None
    return first[0] if all(specs == first for specs in layer_specs) else None


def run(args: argparse.Namespace) -> int:
    if args.path is not None and args.config is not None:
        raise InputError("give the config as a path or as --config, not both")
    path = args.path if args.path is not None else args.config
    model = sized_model(path)
    specs = model.layer_specs
    try:
        dtype = canonical_dtype(args.dtype or _default_dtype(path, model))
        state_dtype = _default_state_dtype(dtype, model) if args.state_dtype is None else \
            canonical_dtype(args.state_dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if state_dtype not in FLOAT_NAMES:
        raise InputError(f"--state-dtype must be a float dtype ({', '.join(FLOAT_NAMES)}), got {args.state_dtype!r}")
    budget = parse_size(args.budget, "--budget") if args.budget is not None else None
    int_in_range(args.batch, "--batch", 1, 2**40)
    if args.tokens is not None:
        int_in_range(args.tokens, "--tokens", 0, 2**40)
    elif model.max_position_embeddings is None:
        raise ConfigError(f"{path}: missing field max_position_embeddings (the default --tokens); pass --tokens")
    tokens = model.max_position_embeddings if args.tokens is None else args.tokens
    batch = args.batch
    rows = group_bytes(specs, tokens, batch, dtype, state_dtype)
    uniform = _uniform_full(specs)
    attention = [spec for layer in specs for spec in layer if isinstance(spec, FullAttentionSpec)]
    per_token = specs_payload_bytes_per_token(specs, dtype)
    kv_bytes = sum((row.kv_bytes for row in rows), Fraction(0))
    state_bytes = sum(row.state_bytes for row in rows)
    unwindowed = sum((spec.bytes_per_token(dtype) for spec in attention), Fraction(0)) * tokens * batch
    result = {
        "model": model.name, "architecture": model.architecture, "sizing_only": model.sizing_only is not None,
        "num_hidden_layers": len(specs),
        "num_key_value_heads": attention[0].num_kv_heads if attention else None,
        "head_dim": attention[0].head_size if attention else None, "dtype": dtype,
        "bytes_per_scalar": DTYPE_BYTES[dtype], "state_dtype": state_dtype,
        "bytes_per_token": _number(per_token), "tokens": tokens, "batch": batch,
        "max_position_embeddings": model.max_position_embeddings,
        "past_context": model.max_position_embeddings is not None and tokens > model.max_position_embeddings,
        "kv_bytes": _number(kv_bytes), "state_bytes": state_bytes, "total_bytes": _number(kv_bytes + state_bytes),
        "kv_bytes_if_full_attention": _number(unwindowed),
        "layer_types": [_group_json(row, state_dtype, batch) for row in rows],
        "bytes_per_token_by_dtype": {d: _number(specs_payload_bytes_per_token(specs, d)) for d in DTYPE_BYTES},
        "scale_bytes_per_token": specs_scale_bytes_per_token(specs, dtype),
        "scale_bytes_per_token_by_dtype": {d: specs_scale_bytes_per_token(specs, d) for d in DTYPE_BYTES},
    }
    if model.sizing_only is not None:
        result["sizing_only_reason"] = model.sizing_only
    weights = gguf_weight_bytes(path) if path else None
    if weights is not None:
        result["weight_bytes_stored"] = weights["weights_stored"]
        result["weight_bytes_stored_q8"] = weights["weights_stored_q8"]
        result["weight_bytes_float32"] = weights["weights_float32"]
        result["file_tensor_bytes"] = weights["file_tensors"]
        mode = args.activations
        if mode == AUTO:  # as kvlab.load resolves it on the compiled backend
            from kvlab.loader import model_config

            mode = default_activations(weights["block_matrices"] > 0, "numba", model_config(path))
        result["activations"] = mode
        result["predicted_peak"] = predicted_peak(weights, int(kv_bytes + state_bytes), mode)
    if budget is not None:
        result["budget_bytes"] = budget
        result["tokens_in_budget"] = specs_tokens_in_budget(specs, budget, batch, dtype, state_dtype)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print(result, model, rows, uniform, tokens, batch, dtype, state_dtype, budget, weights)
    return 0


def _print(result: dict[str, Any], model: SizedModel, rows: list[GroupBytes], uniform: FullAttentionSpec | None,
           tokens: int, batch: int, dtype: str, state_dtype: str, budget: int | None,
           weights: dict[str, int] | None) -> None:
    con = console()
    specs = model.layer_specs
    if model.sizing_only is not None:
        con.print(f"[bold]sizing only[/]: kvlab does not run {model.architecture} ({model.sizing_only}); "
                  "sized from config.json as vLLM's KV-cache specs size it")
    if uniform is not None:
        layers = len(specs)
        con.print(f"[bold]{model.name}[/]: {layers} layers x {uniform.num_kv_heads} KV heads x head_dim "
                  f"{uniform.head_size}")
        con.print(f"K/V bytes per token = 2 x {layers} x {uniform.num_kv_heads} x {uniform.head_size} x "
                  f"{DTYPE_BYTES[dtype]:g} B ({dtype}) = [bold]{result['bytes_per_token']:,.0f}[/] bytes")
    else:
        kinds = ", ".join(f"{len(row.group.layers)} {row.group.spec.label}" for row in rows)
        con.print(f"[bold]{model.name}[/]: {len(specs)} layers: {kinds}")
        con.print(f"K/V bytes per token while every window fills = [bold]{result['bytes_per_token']:,.0f}[/] "
                  f"bytes ({dtype}); states in {state_dtype}")
    past = f" (past max_position_embeddings {model.max_position_embeddings:,})" if result["past_context"] else ""
    total = result["total_bytes"]
    con.print(f"{tokens:,} tokens x batch {batch}{past} = [bold]{total:,.0f}[/] bytes ({human_bytes(float(total))})"
              + (f": K/V {human_bytes(float(result['kv_bytes']))} + states "
                 f"{human_bytes(result['state_bytes'])}" if result["state_bytes"] else ""))
    if result["kv_bytes"] != result["kv_bytes_if_full_attention"]:
        unwindowed = result["kv_bytes_if_full_attention"]
        con.print(f"full attention on every attention layer would hold {human_bytes(float(unwindowed))} of K/V: "
                  f"this holds {result['kv_bytes'] / unwindowed:.3f} of it")
    if weights is not None:
        peak = result["predicted_peak"]
        con.print(f"predicted peak RSS, {tokens:,} tokens x batch {batch}, activations {result['activations']}: "
                  f"[bold]{human_bytes(peak['peak'])}[/]; running: weights {human_bytes(peak['weights'])} + K/V "
                  f"{human_bytes(peak['kv'])} + runtime {human_bytes(peak['runtime'])} = "
                  f"{human_bytes(peak['run_peak'])}; loading: {human_bytes(peak['load_peak'])} (the largest tensor's "
                  "temporaries beside the weights)")
        con.print(f"weights resident: [bold]{human_bytes(weights['weights_stored_q8'])}[/] with int8 activations "
                  f"(q8, the default for block types; the file's tensors: {human_bytes(weights['file_tensors'])}), "
                  f"{human_bytes(weights['weights_stored'])} with exact products (--activations float32: GGUF "
                  "blocks as codes + scales), "
                  f"{human_bytes(weights['weights_float32'])} dequantized to float32")
    if budget is not None:
        fit = result["tokens_in_budget"]
        con.print(f"budget {human_bytes(budget)} holds " + (
            f"[bold]{fit:,}[/] tokens per sequence at batch {batch}" if fit is not None else
            f"any length at batch {batch}: every layer holds a window or a state"))
    scales = result["scale_bytes_per_token"]
    if scales:
        con.print(f"plus scales: a float16 scale and zero per 32 values = [bold]{scales:,.0f}[/] bytes per token "
                  f"of metadata")
    if uniform is None:
        table = Table(title=f"by layer type ({dtype} K/V, {state_dtype} states; {tokens:,} tok x {batch})")
        for name in ("layer type", "layers", "bytes/token/layer", "tokens held", "K/V", "state", "total"):
            table.add_column(name, justify="left" if name == "layer type" else "right")
        for row in rows:
            count = len(row.group.layers)
            table.add_row(row.group.spec.label, str(count), f"{float(row.payload_bytes_per_token / count):,.0f}",
                          f"{row.tokens_held:,}", human_bytes(float(row.kv_bytes)), human_bytes(row.state_bytes),
                          human_bytes(float(row.total_bytes)))
        con.print(table)
    table = Table(title="by cache dtype (payload; int8/int4 add the scales column as metadata)")
    table.add_column("dtype")
    table.add_column("bytes/token", justify="right")
    table.add_column("scales/token", justify="right")
    table.add_column(f"{tokens:,} tok x {batch} with scales" + (" and states" if result["state_bytes"] else ""),
                     justify="right")
    if budget is not None:
        table.add_column("tokens in budget", justify="right")
    for d in DTYPE_BYTES:
        row = [d, f"{float(specs_payload_bytes_per_token(specs, d)):,.0f}",
               f"{specs_scale_bytes_per_token(specs, d):,.0f}",
               human_bytes(float(cache_bytes(specs, tokens, batch, d, state_dtype)))]
        if budget is not None:
            fit = specs_tokens_in_budget(specs, budget, batch, d, state_dtype)
            row.append("any" if fit is None else f"{fit:,}")
        table.add_row(*row, style="bold" if d == dtype else None)
    con.print(table)
