"""Weight quantization: a model's matrices in GGUF block types, and what that costs in quality.

`quantize_weights` turns every weight matrix (embeddings and LM head included, as llama-quantize does for
a single `--type`; norms and biases stay float) into a QuantizedMatrix with llama.cpp's own encoder.
`weight_fidelity` measures the damage like `llama-perplexity --kl-divergence`: the quantized model and the
float model read the same held-out windows, and per type it reports perplexity (and its change), KL(float
|| quantized) per position (mean, max) and top-1 agreement, with the bytes per weight the type takes in a
file and resident in kvlab.

The quantized model's logits here come from the dequantized values in float32 (exactly the file's
weights); the kernels that read the codes compute the same products up to summation order.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from kvlab.errors import InputError
from kvlab.model.llama import LlamaModel
from kvlab.model.quantized import QuantizedMatrix
from kvlab.perplexity import log_softmax, windows

# Types kvlab can encode (llama.cpp's reference encoders in the gguf package); every BLOCK_TYPES type reads.
QUANTIZE_TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def quant_type(name: str) -> str:
    """'q8_0' / 'Q8_0' -> 'Q8_0'; InputError naming the choices for anything else."""
    if not isinstance(name, str) or name.lower() not in QUANTIZE_TYPES:
        raise InputError(f"unknown weight quantization {name!r}; choose from {', '.join(QUANTIZE_TYPES)}")
    return name.upper()


def quantize_weights(weights: Mapping[str, np.ndarray], type_name: str,
                     ) -> dict[str, np.ndarray | QuantizedMatrix]:
    """Every 2-D float matrix of `weights` as a QuantizedMatrix of `type_name`; 1-D tensors unchanged."""
    kind = quant_type(type_name)
    return {name: QuantizedMatrix.quantize(w, kind) if np.ndim(w) == 2 else w for name, w in weights.items()}


def dequantized(weights: Mapping[str, np.ndarray | QuantizedMatrix]) -> dict[str, np.ndarray]:
    """Quantized matrices as float32 arrays of their exact values (for a float model of the same weights)."""
    return {name: w.dequantize() if isinstance(w, QuantizedMatrix) else w for name, w in weights.items()}


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
    resident_bytes_per_weight: float  # as kvlab keeps them (codes + float32 scales/offsets)

    def to_dict(self) -> dict:
        return asdict(self)


def _matrix_bytes(weights: Mapping[str, np.ndarray | QuantizedMatrix]) -> tuple[float, float]:
    matrices = [w for w in weights.values() if np.ndim(w) == 2 or isinstance(w, QuantizedMatrix)]
    count = sum(int(np.prod(w.shape)) for w in matrices)
    file_bytes = sum(w.file_bytes if isinstance(w, QuantizedMatrix) else w.nbytes for w in matrices)
    resident = sum(w.nbytes for w in matrices)
    return file_bytes / count, resident / count


def weight_fidelity(config, weights: Mapping[str, np.ndarray], token_ids: Sequence[int], bos_token_id: int,
                    types: Sequence[str] = QUANTIZE_TYPES, context: int | None = None,
                    progress: Callable[[str], None] | None = None) -> list[WeightFidelityRow]:
    """One row for the float weights ("float32", first) and one per quantization type, over `token_ids`."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise InputError("weight fidelity needs a non-empty 1-D token stream")
    kinds = [quant_type(t) for t in types]  # all refused before any run
    context = context or config.max_position_embeddings
    if not 0 < context <= config.max_position_embeddings:
        raise InputError(f"context must be in 1..{config.max_position_embeddings}, got {context}")
    float_weights = {name: np.asarray(w, dtype=np.float32) for name, w in weights.items()}
    reference = LlamaModel(config, float_weights, dtype=np.float32)
    variants: list[tuple[str, Mapping]] = [("float32", float_weights)]
    variants += [(kind, quantize_weights(float_weights, kind)) for kind in kinds]
    spans = list(windows(len(ids), context, context))
    exact_logp = []
    for b, i, e in spans:
        window = np.concatenate([[bos_token_id], ids[b:e - 1]])[None]
        exact_logp.append(log_softmax(reference.forward(window).logits[0])[i - b:])
    rows: list[WeightFidelityRow] = []
    for name, variant in variants:
        if progress:
            progress(f"weights {name}")
        model = reference if name == "float32" else LlamaModel(config, dequantized(variant), dtype=np.float32)
        kl_total = kl_max = nll = 0.0
        agree = count = 0
        for (b, i, e), exact in zip(spans, exact_logp):
            window = np.concatenate([[bos_token_id], ids[b:e - 1]])[None]
            logp = log_softmax(model.forward(window).logits[0])[i - b:]
            targets = ids[i:e]
            kl = np.maximum((np.exp(exact) * (exact - logp)).sum(axis=-1), 0.0)
            kl_total += float(kl.sum())
            kl_max = max(kl_max, float(kl.max()))
            agree += int((logp.argmax(-1) == exact.argmax(-1)).sum())
            nll -= float(logp[np.arange(targets.size), targets].sum())
            count += targets.size
        file_bpw, resident_bpw = _matrix_bytes(variant)
        ppl = math.exp(nll / count)
        rows.append(WeightFidelityRow(name=name, tokens=count, kl_mean=kl_total / count, kl_max=kl_max,
                                      top1_agreement=agree / count, perplexity=ppl,
                                      perplexity_change=ppl / rows[0].perplexity - 1 if rows else 0.0,
                                      file_bytes_per_weight=file_bpw, resident_bytes_per_weight=resident_bpw))
    return rows


def read_float_weights(path: object = None) -> tuple[object, dict[str, np.ndarray]]:
    """(config, float32 weights by HF name) of an HF folder or a GGUF file (dequantized); None: the default."""
    from kvlab.gguf.loader import gguf_file, read_checkpoint
    from kvlab.hf.loader import check_headers, load_config, read_weights, resolve_model_dir, weight_headers

    if gguf_file(path) is not None:
        checkpoint = read_checkpoint(path, np.float32, progress=False)
        return checkpoint.config, dict(checkpoint.weights)
    folder = resolve_model_dir(path)
    config = load_config(folder)
    headers, _, source = weight_headers(folder)
    check_headers(config, headers, source)
    return config, read_weights(headers, np.dtype(np.float32), False, keep_half=False)
