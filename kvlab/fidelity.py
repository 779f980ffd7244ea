"""Fidelity: how much a lossy cache (quantized storage, an eviction policy, or both) changes the model.

The held-out token stream is cut into windows of `context` tokens, each opened by <bos> as in
kvlab/perplexity.py. Every cache choice reads each window in the engine, one token a step (so a policy
evicts exactly when a real generation would; Engine.score), and its next-token distribution at every position is
compared with the exact cache's: KL(exact || choice) in nats (mean and max over positions), top-1
agreement, and perplexity. Memory is the K/V payload plus quantization scales per cached token, and the
most the cache ever held; speed is decode tokens per second over the same steps (all choices run side by
side in one process, so the ratios mean more than the absolute numbers on a shared machine).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from kvlab.errors import ConfigError, InputError
from kvlab.model.llama import LlamaModel
from kvlab.model.quantized import QUANTIZE_TYPES, QuantizedMatrix, dequantized, quantize_weights, weight_choice
from kvlab.perplexity import log_softmax, windows
from kvlab.policies.parse import CacheChoice, parse_cache_choice

DEFAULT_CHOICES = ("exact", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int8-channel", "int4",
                   "int4-channel", "window:64", "sinks:4:60", "shift:4:64", "int8+sinks:4:60")


@dataclass(frozen=True)
class FidelityRow:
    name: str
    kv_dtype: str
    policy: str
    tokens: int
    kl_mean: float          # nats, KL(exact || this) averaged over positions
    kl_max: float
    top1_agreement: float   # fraction of positions whose argmax equals the exact cache's
    perplexity: float
    perplexity_change: float  # relative to the exact cache: 0.01 = +1 %
    bytes_per_token: float  # K/V payload + scales per cached token, all layers
    peak_tokens: int        # most positions the cache held at once
    peak_bytes: int         # payload + scales at that point
    evicted_tokens: int     # rows dropped by the policy over the run
    decode_tokens_per_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Run:
    """What one cache choice produced over one window."""

    logp: np.ndarray
    seconds: float
    peak_tokens: int
    peak_bytes: int
    evicted: int


def _read_window(model: LlamaModel, window: np.ndarray, choice: CacheChoice) -> _Run:
    """The choice's log-probabilities after every token of `window` [1, T], fed one token per step.

    Every choice runs in the engine (kvlab/engine), as `kvlab generate` and the server would run it: its
    block pool in the choice's dtype, its cache policy, one token a step so that a policy evicts exactly
    when a generation would. Per-channel keys (KIVI), which a block pool cannot hold, and the reference run
    read the contiguous KVCache, one `model.forward` a token."""
    if choice.policy is None and (choice.name == "reference" or _channel_keys(choice)):
        return _read_contiguous(model, window, choice)
    from kvlab.engine.engine import Engine

    length = window.shape[1]
    engine = Engine(model, **_engine_settings(choice, length))
    start = time.perf_counter()
    score = engine.score([int(t) for t in window[0]])
    seconds = time.perf_counter() - start
    per_token = engine.block_pool.bytes_per_block / _BLOCK
    return _Run(log_softmax(np.stack(score.logits)), seconds, score.peak_rows,
                round(score.peak_rows * per_token), length - score.rows)


_BLOCK = 16  # block size of the engine's pool in fidelity runs (bytes per token do not depend on it)


def _engine_settings(choice: CacheChoice, length: int) -> dict:
    """The engine a choice reads a window of `length` tokens in: one token a step, no prefix caching, a
    pool with room for the window (a policy holds less)."""
    return dict(kv_cache_dtype=choice.kv_dtype, kv_policy=choice.policy, max_num_batched_tokens=1,
                block_size=_BLOCK, num_blocks=2 * (-(-(length + 1) // _BLOCK)) + 2, enable_prefix_caching=False,
                max_model_len=length)


def _check_choice(model: LlamaModel, choice: CacheChoice, context: int) -> None:
    """Refuse a choice the engine would refuse, before any choice runs (its config is checked, nothing
    allocated)."""
    if _channel_keys(choice):
        if choice.policy is not None:
            raise InputError(f"{choice.name}: per-channel keys ({choice.kv_dtype}) are kept only by the contiguous "
                             "cache, and cache policies run in the engine's block pool; measure them apart")
        return
    from kvlab.engine.config import EngineConfig

    try:
        EngineConfig.create(model, **_engine_settings(choice, context))
    except ConfigError as exc:
        raise InputError(f"{choice.name}: {exc}") from None


def _channel_keys(choice: CacheChoice) -> bool:
    return choice.kv_dtype is not None and choice.kv_dtype.lower().endswith("-channel")


def _read_contiguous(model: LlamaModel, window: np.ndarray, choice: CacheChoice) -> _Run:
    cache = model.new_cache(kv_dtype=choice.kv_dtype, capacity=window.shape[1])
    rows, seconds, peak_bytes = [], 0.0, 0
    for t in range(window.shape[1]):
        start = time.perf_counter()
        logits = model.forward(window[:, t:t + 1], cache=cache, logits_to_keep=1).logits
        seconds += time.perf_counter() - start
        rows.append(logits[0, -1])
    report = cache.memory_report()
    peak_bytes = report.payload_bytes + report.scale_bytes
    return _Run(log_softmax(np.stack(rows)), seconds, cache.get_seq_length(), peak_bytes, 0)


def _score(totals: dict, exact: np.ndarray, logp: np.ndarray, targets: np.ndarray,
           p_exact: np.ndarray | None = None) -> None:
    """Add one window's KL(exact || this) (sum and max), top-1 agreements and NLL of `targets` to `totals`
    (log-probabilities [positions, vocab]; `p_exact` = exp(exact) when the caller already has it)."""
    p_exact = np.exp(exact) if p_exact is None else p_exact
    kl = np.maximum((p_exact * (exact - logp)).sum(axis=-1), 0.0)
    totals["kl"] += float(kl.sum())
    totals["kl_max"] = max(totals["kl_max"], float(kl.max()))
    totals["agree"] += int((logp.argmax(-1) == exact.argmax(-1)).sum())
    totals["nll"] -= float(logp[np.arange(targets.size), targets].sum())


def measure_fidelity(model: LlamaModel, token_ids: Sequence[int], bos_token_id: int,
                     choices: Sequence[str] = DEFAULT_CHOICES, context: int | None = None,
                     progress: Callable[[str], None] | None = None) -> list[FidelityRow]:
    """One FidelityRow per cache choice ("exact" is always measured, first), over `token_ids`.

    Perplexity changes are relative to the "exact" row."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise InputError("fidelity needs a non-empty 1-D token stream")
    context = context or model.config.max_position_embeddings
    if not 0 < context <= model.config.max_position_embeddings:
        raise InputError(f"context must be in 1..{model.config.max_position_embeddings}, got {context}")
    names = ["exact"] + [c for c in choices if c.strip().lower() != "exact"]
    parsed = [parse_cache_choice(c, context, model.dtype) for c in names]  # all refused before any run
    for choice in parsed:
        _check_choice(model, choice, context)
    totals = {c.name: dict(kl=0.0, kl_max=0.0, agree=0, nll=0.0, seconds=0.0, peak_tokens=0, peak_bytes=0,
                           evicted=0) for c in parsed}
    count = 0
    for number, (b, i, e) in enumerate(windows(len(ids), context, context)):
        window = np.concatenate([[bos_token_id], ids[b:e - 1]])[None]
        targets = ids[b:e]
        # The reference: the same decode steps with a plain cache, run apart from every choice (so the
        # "exact" choice, which goes through the same machinery as the others, is checked against it).
        scored = slice(i - b, None)  # a last, shorter window re-reads earlier tokens but scores only new ones
        exact = _read_window(model, window, CacheChoice("reference", None, None)).logp[scored]
        p_exact = np.exp(exact)
        targets = targets[scored]
        for choice in parsed:
            if progress:
                progress(f"window {number + 1} ({e}/{len(ids)} tokens): {choice.name}")
            run = _read_window(model, window, choice)
            logp = run.logp[scored]
            t = totals[choice.name]
            _score(t, exact, logp, targets, p_exact)
            t["seconds"] += run.seconds
            t["evicted"] += run.evicted
            if run.peak_tokens > t["peak_tokens"]:
                t["peak_tokens"], t["peak_bytes"] = run.peak_tokens, run.peak_bytes
        count += targets.size
    exact_ppl = math.exp(totals[parsed[0].name]["nll"] / count)
    rows = []
    for choice in parsed:
        t = totals[choice.name]
        ppl = math.exp(t["nll"] / count)
        rows.append(FidelityRow(
            name=choice.name, kv_dtype=str(choice.kv_dtype or np.dtype(model.dtype).name),
            policy=str(choice.policy or "full"), tokens=count, kl_mean=t["kl"] / count, kl_max=t["kl_max"],
            top1_agreement=t["agree"] / count, perplexity=ppl, perplexity_change=ppl / exact_ppl - 1,
            bytes_per_token=t["peak_bytes"] / max(t["peak_tokens"], 1), peak_tokens=t["peak_tokens"],
            peak_bytes=t["peak_bytes"], evicted_tokens=t["evicted"],
            decode_tokens_per_s=count / t["seconds"] if t["seconds"] else 0.0))
    return rows


# --- weight quantization ------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFidelityRow:
    name: str
    tokens: int
    kl_mean: float           # nats, KL(float || quantized) averaged over positions
    kl_max: float
    top1_agreement: float    # fraction of positions whose argmax equals the float model's
    perplexity: float
    perplexity_change: float  # relative to the float model: 0.01 = +1 %
    file_bytes_per_weight: float      # as ggml blocks in a GGUF file (matrices only)
    resident_bytes_per_weight: float  # as kvlab keeps them (codes + float32 scales/offsets; q8: + dot layout)

    def to_dict(self) -> dict:
        return asdict(self)


def _matrix_bytes(weights: Mapping[str, np.ndarray | QuantizedMatrix], activations: str) -> tuple[float, float]:
    """(file, resident) bytes per weight of the matrices; resident as a model computing with `activations`
    keeps them (int8 activations add the integer kernels' layout)."""
    matrices = [w for w in weights.values() if np.ndim(w) == 2 or isinstance(w, QuantizedMatrix)]
    count = sum(int(np.prod(w.shape)) for w in matrices)
    file_bytes = sum(w.file_bytes if isinstance(w, QuantizedMatrix) else w.nbytes for w in matrices)
    resident = sum(w.resident_bytes(activations) if isinstance(w, QuantizedMatrix) else w.nbytes for w in matrices)
    return file_bytes / count, resident / count


def weight_fidelity(config, weights: Mapping[str, np.ndarray], token_ids: Sequence[int], bos_token_id: int,
                    types: Sequence[str] = QUANTIZE_TYPES, context: int | None = None,
                    progress: Callable[[str], None] | None = None) -> list[WeightFidelityRow]:
    """One row for the float weights ("float32", first) and one per quantization type, over `token_ids`.
    A type with "+q8" ("q8_0+q8") also rounds every quantized product's input to int8 (model/act_quant.py):
    what llama.cpp computes on such a file; it runs on the quantized kernels, the others as float models of
    the dequantized values (the same logits, faster)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise InputError("weight fidelity needs a non-empty 1-D token stream")
    choices = [weight_choice(t) for t in types]  # all refused before any run
    context = context or config.max_position_embeddings
    if not 0 < context <= config.max_position_embeddings:
        raise InputError(f"context must be in 1..{config.max_position_embeddings}, got {context}")
    float_weights = {name: np.asarray(w, dtype=np.float32) for name, w in weights.items()}
    reference = LlamaModel(config, float_weights, dtype=np.float32)
    quantized = {kind: quantize_weights(float_weights, kind) for kind, _ in choices}
    variants: list[tuple[str, Mapping, str]] = [("float32", float_weights, "float32")]
    variants += [(kind if activations == "float32" else f"{kind}+{activations}", quantized[kind], activations)
                 for kind, activations in choices]
    spans = list(windows(len(ids), context, context))
    exact_logp = []
    for b, i, e in spans:
        window = np.concatenate([[bos_token_id], ids[b:e - 1]])[None]
        exact_logp.append(log_softmax(reference.forward(window).logits[0])[i - b:])
    rows: list[WeightFidelityRow] = []
    for name, variant, activations in variants:
        if progress:
            progress(f"weights {name}")
        if name == "float32":
            model = reference
        elif activations == "float32":
            model = LlamaModel(config, dequantized(variant), dtype=np.float32)
        else:
            model = LlamaModel(config, variant, dtype=np.float32, activations=activations)
        t = dict(kl=0.0, kl_max=0.0, agree=0, nll=0.0)
        count = 0
        for (b, i, e), exact in zip(spans, exact_logp):
            window = np.concatenate([[bos_token_id], ids[b:e - 1]])[None]
            logp = log_softmax(model.forward(window).logits[0])[i - b:]
            targets = ids[i:e]
            _score(t, exact, logp, targets)
            count += targets.size
        file_bpw, resident_bpw = _matrix_bytes(variant, activations)
        ppl = math.exp(t["nll"] / count)
        rows.append(WeightFidelityRow(name=name, tokens=count, kl_mean=t["kl"] / count, kl_max=t["kl_max"],
                                      top1_agreement=t["agree"] / count, perplexity=ppl,
                                      perplexity_change=ppl / rows[0].perplexity - 1 if rows else 0.0,
                                      file_bytes_per_weight=file_bpw, resident_bytes_per_weight=resident_bpw))
    return rows
