"""The Llama-family decoder: embed -> blocks (attention, SwiGLU MLP) -> norm -> head.

From ids to logits: `forward(ids [B, T], cache)` validates the ids, takes positions from the cache's
num_cached_tokens (start .. start + T - 1) and flattens the B rows into one batch of N = B * T tokens.
`run_layers` embeds them (x [N, hidden], the residual stream) and runs the one layer loop:

    for index, layer in enumerate(layers):
        q, k, v = ops.qkv_rope(x, layer, rope)   # model/ops.py: norm, fused q/k/v product, RoPE
        o = attention(index, q, k, v)            # model/attention.py: write K/V, attend
        ops.output_mlp(x, o, layer)              # output product, norm, SwiGLU MLP, both residuals

then the final norm and LM head give logits, and the cache commits the new rows (only once every layer
wrote). On the compiled backend, a step whose rows all take the decode kernel (a decode step; any step
with batch-invariant attention) over a cache the kernels write in place runs each block whose halves both
fuse as one call instead (`ops.decode_block` with the operands of the attention's `fused_step`:
kernels/decode_block.py), the same three steps with no Python between them, bit for bit. The engine's
batched step (`forward_batch`) runs the same loop over its ragged flat batch with a PagedAttention over
the block pool. Prefill, chunked prefill and decode are all this one path.

Two seams: Ops is the math (`backend="numpy"`: the reference, the math as on the page; `"numba"`, the
default where numba imports: compiled kernels that read bfloat16/float16 weights in place and compute in
float32), chosen once here. Attention is the only code that touches K/V storage; the model knows the two
storage protocols of kvlab/cache/base.py and no concrete cache class. Weights are fused on load (q/k/v
into one matrix, gate/up into another), kept [out, in] for the fastest matrix-vector product (see Layer)
and packed in one buffer in the order a step reads them. Weight matrices keep their checkpoint precision
when `weights_dtype="auto"`: a bfloat16 file streams half the bytes per step, and its logits still equal
a float32 run of the same weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from kvlab import validate
from kvlab.cache.base import Cache, CacheSpec, PagedKV
from kvlab.cache.contiguous import MIN_CAPACITY
from kvlab.cache.kv_cache import new_cache
from kvlab.config import ModelConfig, tiny_config
from kvlab.errors import ContextLengthError, InputError
from kvlab.kernels import resolve_backend
from kvlab.model.act_quant import check_activations
from kvlab.model.attention import Attention, ContiguousAttention, PagedAttention
from kvlab.model.batch import BatchInput
from kvlab.model.layers import softcap
from kvlab.model.ops import Rope, make_ops
from kvlab.model.quantized import QuantizedMatrix, prepare_layout, stack_rows
from kvlab.model.rope import RopeTables, rotary_row_order
from kvlab.model.weights import check_weights, fingerprint, random_weights, resolve_weights_dtype


@dataclass
class ForwardOutput:
    """logits [B, T_new (or logits_to_keep), vocab] and the cache that now holds the new positions."""

    logits: np.ndarray
    cache: Cache | None


@dataclass
class Layer:
    """One block's weights. Matrices are [out, in] (HF's layout, used as `x @ w.T`) in the storage dtype
    (float32, or bfloat16/float16 as the checkpoint has them): each output is a dot product over one
    contiguous row, the layout the compiled gemv streams fastest. Norms and biases are in the compute dtype."""

    input_norm: np.ndarray
    w_qkv: np.ndarray          # [(H_q + 2 H_kv) d, hidden]
    b_qkv: np.ndarray | None
    w_o: np.ndarray            # [hidden, H_q d]
    b_o: np.ndarray | None
    post_norm: np.ndarray      # the MLP's input norm (Gemma's pre_feedforward_layernorm)
    w_gate_up: np.ndarray      # [2 intermediate, hidden]
    w_down: np.ndarray         # [hidden, intermediate]
    # the families' hooks (None: absent, Llama): per-head norms of q and k before RoPE (Qwen3, Gemma 3),
    # norms of the attention output and of the MLP output before their residuals (Gemma)
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    attn_out_norm: np.ndarray | None = None
    mlp_out_norm: np.ndarray | None = None

    @property
    def plain_mlp(self) -> bool:
        """The half after attention is Llama's (the fused `output_mlp`'s shape): no norm of the attention
        output or of the MLP output before their residuals (Gemma has both). The half before attention
        fuses whatever the family: the q/k norms are in the fused `qkv_rope` (model/ops.py)."""
        return self.attn_out_norm is None and self.mlp_out_norm is None


def validate_ids(ids: Any, vocab_size: int) -> np.ndarray:
    """Return ids as an int64 [B, T] array, or raise InputError naming what is wrong with them."""
    try:
        array = np.asarray(ids)
    except ValueError as exc:  # ragged nested lists
        raise InputError(f"ids must be a rectangular [batch, tokens] array of ints ({exc})") from None
    if array.ndim != 2:
        raise InputError(f"ids must be 2-D [batch, new_tokens], got shape {array.shape}")
    if array.size == 0:
        raise InputError(f"ids is empty (shape {array.shape}): every forward needs at least one token")
    if array.dtype.kind not in "iu":
        raise InputError(f"ids must be integers, got dtype {array.dtype}")
    outside = validate.out_of_vocab(array, vocab_size)
    if outside is not None:
        bad, where = outside
        raise InputError(f"token id {bad} at {where} is outside the vocabulary [0, {vocab_size})")
    return array.astype(np.int64, copy=False)


def _no_quantized_matrices(activations: str, source: str) -> str:
    return (f"activations={activations!r} rounds the inputs of quantized matrices, and {source} has none: load "
            "a GGUF file of a block type as stored (the default; `kvlab quantize SRC OUT.gguf --type q4_0` "
            "writes one), or an HF folder with weights_dtype='q8_0' (or another block type)")


class LlamaModel:
    """A Llama-family decoder in NumPy (Llama, Mistral, Qwen2/3, SmolLM3, Phi-3/4, Gemma 2/3: the config's
    hooks, see kvlab/config.py). `forward(ids, cache=..., use_cache=...)`."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray] | None = None,
                 dtype: object = np.float32, seed: int = 0, source: str = "weights",
                 weights_dtype: object = None, backend: str | None = None, activations: str | None = None) -> None:
        """`weights_dtype`: None (cast to `dtype`), "auto" (keep a half-precision checkpoint as stored),
        or "float16"/"bfloat16"; `backend`: None/"auto" (compiled where available), "numba" or "numpy";
        `activations`: None/"float32" (exact products) or "q8" (the inputs of quantized matrices rounded to
        int8 per group, llama.cpp's way: lossy, model/act_quant.py; needs quantized weights)."""
        self.config = config
        if not isinstance(config, ModelConfig):
            raise InputError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.dtype = validate.compute_dtype(dtype)
        self.backend = resolve_backend(backend)
        self.weights_dtype_request = weights_dtype
        self.activations = check_activations(activations)
        self.rope_tables = RopeTables(config, self.dtype)
        self.inv_freq = self.rope_tables.inv_freq
        self.layer_rope = [config.layer_rope(i) for i in range(config.num_hidden_layers)]
        self.set_weights(weights if weights is not None else random_weights(config, seed, self.dtype), source)

    # --- weights -----------------------------------------------------------------------------------------
    def set_weights(self, weights: Mapping[str, np.ndarray], source: str = "weights") -> None:
        """Check, cast, fingerprint and fuse a state dict with HF names. Caches made before are refused."""
        check_weights(self.config, weights, source)
        used = {name: array for name, array in weights.items() if not name.endswith("inv_freq")}
        if self.config.tie_word_embeddings:
            used.pop("lm_head.weight", None)
        quantized = {name for name, array in used.items() if isinstance(array, QuantizedMatrix)}
        floats = {name: array for name, array in used.items() if name not in quantized}
        self.weights_dtype = resolve_weights_dtype(self.weights_dtype_request, self.dtype, floats, source)
        cast = {name: array if name in quantized else
                np.ascontiguousarray(array, dtype=self.weights_dtype if array.ndim == 2 else self.dtype)
                for name, array in used.items()}
        if self.activations != "float32" and not quantized:
            raise InputError(_no_quantized_matrices(self.activations, source))
        self._weights_fingerprint = fingerprint(self.config, self.dtype, cast)
        self.embed = cast["model.embed_tokens.weight"]
        self.norm = self._norm_weight(cast["model.norm.weight"])
        self.lm_head = self.embed if self.config.tie_word_embeddings else cast["lm_head.weight"]  # [vocab, hidden]
        self.quantized = bool(quantized)  # GGUF blocks kept as stored: the quantized Ops (model/ops.py)
        self.layers = self._quantized_layers(cast) if quantized else self._fuse_layers(cast)
        self._bind_ops()

    def set_activations(self, activations: str | None) -> None:
        """Round the inputs of the quantized products to int8 ("q8") or not ("float32"/None). The model's
        fingerprint changes with it, so caches made under the other setting are refused."""
        name = check_activations(activations)
        if name != "float32" and not self.quantized:
            raise InputError(_no_quantized_matrices(name, "this model"))
        self.activations = name
        self._bind_ops()

    def _bind_ops(self) -> None:
        """The math (model/ops.py) for these weights and activations, and the layers as it reads them."""
        self._fingerprint = self._weights_fingerprint if self.activations == "float32" else hashlib.sha256(
            f"{self._weights_fingerprint}|activations={self.activations}".encode()).hexdigest()
        self.ops = make_ops(self.backend, self.config, self.dtype, self.quantized, self.activations)
        self._bound_layers = []  # the old binding's arrays go first: a layout change holds one matrix twice, not all
        self._bound_layers = self.ops.bind(self.layers)
        mode = self.activations if self.backend == "numba" else "float32"  # the layout the products read
        for matrix in (self.embed, self.lm_head, *(getattr(layer, name) for layer in self.layers
                                                   for name in ("w_qkv", "w_o", "w_gate_up", "w_down"))):
            prepare_layout(matrix, mode)  # one layout everywhere, settled now: the embedding lookup reads either

    def _fuse_layers(self, cast: Mapping[str, np.ndarray]) -> list[Layer]:
        """Per-layer fused matrices, all in one buffer in the order a forward reads them.

        Why one buffer: a decode step streams every matrix once, and one long hugepage-backed run in
        reading order lets the prefetchers keep going from one matrix into the next (a few percent per
        step, measured); separate small arrays get 4 KiB pages and scattered addresses.
        """
        c = self.config
        h, q_out = c.hidden_size, c.num_attention_heads * c.head_dim
        qkv_out = q_out + 2 * c.num_key_value_heads * c.head_dim
        shapes = {"w_qkv": (qkv_out, h), "w_o": (h, q_out), "w_gate_up": (2 * c.intermediate_size, h),
                  "w_down": (h, c.intermediate_size)}
        per_layer = sum(a * b for a, b in shapes.values())
        buffer = np.empty(per_layer * c.num_hidden_layers, dtype=self.weights_dtype)
        offset = 0

        def take(name: str) -> np.ndarray:
            nonlocal offset
            size = shapes[name][0] * shapes[name][1]
            view = buffer[offset:offset + size].reshape(shapes[name])
            offset += size
            return view

        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            w_qkv, w_o, w_gate_up, w_down = take("w_qkv"), take("w_o"), take("w_gate_up"), take("w_down")
            row = 0
            for x in "qkv":  # [out, in] checkpoint matrices stacked: one product gives q, k and v
                part = self._qk_rows(x, cast[f"{attn}{x}_proj.weight"])
                w_qkv[row:row + part.shape[0]] = part
                row += part.shape[0]
            w_o[...] = cast[attn + "o_proj.weight"]
            w_gate_up[:c.intermediate_size] = cast[mlp + "gate_proj.weight"]
            w_gate_up[c.intermediate_size:] = cast[mlp + "up_proj.weight"]
            w_down[...] = cast[mlp + "down_proj.weight"]
            layers.append(Layer(w_qkv=w_qkv, w_o=w_o, w_gate_up=w_gate_up, w_down=w_down,
                                **self._layer_vectors(cast, i)))
        return layers

    def _qk_rows(self, part: str, weight: Any) -> Any:
        """q_proj / k_proj rows (or biases) in the head order RoPE tables expect: with partial rotary,
        each head's rotated channels first in each half (model/rope.py); v and full rotary unchanged."""
        c = self.config
        if part == "v" or c.rotary_dim == c.head_dim:
            return weight
        heads = c.num_attention_heads if part == "q" else c.num_key_value_heads
        order = (np.arange(heads)[:, None] * c.head_dim + rotary_row_order(c.head_dim, c.rotary_dim)).reshape(-1)
        return weight.take_rows(order) if isinstance(weight, QuantizedMatrix) else weight[order]

    def _norm_weight(self, weight: np.ndarray | None) -> np.ndarray | None:
        """A norm's scale as the forward multiplies by it: w, or Gemma's (1 + w) (in the compute dtype,
        as transformers adds in float32), channels in the head order for the q/k norms' callers."""
        if weight is None or not self.config.norm_weight_offset:
            return weight
        return weight + self.dtype.type(self.config.norm_weight_offset)

    def _layer_vectors(self, cast: Mapping[str, Any], i: int) -> dict[str, Any]:
        """Layer i's norms and biases under the family's names (Gemma's post_attention_layernorm is the
        attention output's norm, its pre_feedforward_layernorm the MLP input's)."""
        c, p = self.config, f"model.layers.{i}."
        attn = p + "self_attn."
        has_bias = cast.get(attn + "q_proj.bias") is not None
        head_order = rotary_row_order(c.head_dim, c.rotary_dim)
        vectors: dict[str, Any] = dict(
            input_norm=self._norm_weight(cast[p + "input_layernorm.weight"]),
            b_qkv=np.concatenate([self._qk_rows(x, cast[f"{attn}{x}_proj.bias"]) for x in "qkv"])
            if has_bias else None, b_o=cast.get(attn + "o_proj.bias"))
        if c.qk_norm:
            vectors["q_norm"] = self._norm_weight(cast[attn + "q_norm.weight"])[head_order]
            vectors["k_norm"] = self._norm_weight(cast[attn + "k_norm.weight"])[head_order]
        if c.sandwich_norm:
            vectors["attn_out_norm"] = self._norm_weight(cast[p + "post_attention_layernorm.weight"])
            vectors["post_norm"] = self._norm_weight(cast[p + "pre_feedforward_layernorm.weight"])
            vectors["mlp_out_norm"] = self._norm_weight(cast[p + "post_feedforward_layernorm.weight"])
        else:
            vectors["post_norm"] = cast[p + "post_attention_layernorm.weight"]
        return vectors

    def _quantized_layers(self, cast: Mapping[str, Any]) -> list[Layer]:
        """Per-layer matrices of a quantized model: q/k/v and gate/up stacked by rows as they are stored
        (one QuantizedMatrix when their types agree, else a RowStack); no float copy is made."""
        layers = []
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            layers.append(Layer(
                w_qkv=stack_rows([self._qk_rows(x, cast[f"{attn}{x}_proj.weight"]) for x in "qkv"]),
                w_o=cast[attn + "o_proj.weight"],
                w_gate_up=stack_rows([cast[mlp + "gate_proj.weight"], cast[mlp + "up_proj.weight"]]),
                w_down=cast[mlp + "down_proj.weight"], **self._layer_vectors(cast, i)))
        return layers

    @property
    def fingerprint(self) -> str:
        """SHA-256 of config, dtype and weights, computed once per `set_weights` (never per step)."""
        return self._fingerprint

    @property
    def cache_spec(self) -> CacheSpec:
        c = self.config
        return CacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype, self._fingerprint)

    def new_cache(self, batch_size: int = 1, kv_dtype: object = None, capacity: int = MIN_CAPACITY) -> Cache:
        """An empty KVCache for this model; `capacity` preallocates that many positions."""
        return new_cache(self.cache_spec, batch_size, kv_dtype, capacity)

    # --- forward -----------------------------------------------------------------------------------------
    def rope(self, positions: np.ndarray | slice, kind: str = "global") -> Rope:
        """cos and sign-folded sin ([-sin, sin]) [N, d] of each token's absolute position (an array, or a
        slice start:end of them: views, no copy) for a layer kind ("global", "local", "none";
        model/rope.py), from tables grown by doubling."""
        return self.rope_tables(positions, kind)

    def run_layers(self, token_ids: np.ndarray, positions: np.ndarray | slice,
                   attention: Attention) -> np.ndarray:
        """The decoder blocks over a flat batch of N tokens ([N] ids at [N] absolute positions, or a slice
        of consecutive ones): the one layer loop every forward runs. `attention` owns the K/V
        (model/attention.py); returns the final residual stream [N, hidden], before the last norm."""
        x = self.embed_tokens(token_ids)  # a fresh [N, hidden] array: the residual stream, updated in place
        ropes, ops = {kind: self.rope(positions, kind) for kind in self.rope_tables.kinds}, self.ops
        # a block in one call where it fuses and the attention can run inside it (`fused_step`)
        fused = getattr(attention, "fused_step", None) if ops.compiled else None
        rows = x.shape[0]
        with np.errstate(over="ignore"):  # swiglu's exp(-gate) may overflow to inf: correct, and silent
            for index, layer in enumerate(self._bound_layers):
                rope = ropes[self.layer_rope[index]]
                if fused is not None and ops.block_fuses(layer, rows):
                    step = fused(index)
                    if step is not None:
                        ops.decode_block(x, layer, rope, step)
                        continue
                q, k, v = ops.qkv_rope(x, layer, rope)
                o = attention(index, q, k, v)
                ops.output_mlp(x, o, layer)
        return x

    def forward(self, ids: Any, cache: Cache | None = None, use_cache: bool = False,
                logits_to_keep: int = 0) -> ForwardOutput:
        """Run the new positions `ids` [B, T_new]; with a cache they continue from it and are appended.

        `logits_to_keep=k` returns logits for the last k positions only (0 = all), which spares the LM-head
        matmul over a long prompt during generation. Everything is validated before the cache is touched.
        """
        config = self.config
        ids = validate_ids(ids, config.vocab_size)
        batch, num_new = ids.shape
        if cache is not None:
            if not callable(getattr(cache, "check_compatible", None)):  # (a Protocol isinstance costs ~20 us)
                raise InputError(f"cache must be a KVCache, got {type(cache).__name__}")
            cache.check_compatible(self.cache_spec, batch)
        start = cache.get_seq_length() if cache is not None else 0
        end = start + num_new
        if end > config.max_position_embeddings:
            raise ContextLengthError(
                f"positions {start}..{end - 1} exceed the model's context of "
                f"{config.max_position_embeddings} tokens (max_position_embeddings)")
        logits_to_keep = validate.int_in_range(logits_to_keep, "logits_to_keep", 0)
        if cache is None and use_cache:
            cache = self.new_cache(batch, capacity=max(end, MIN_CAPACITY))

        # B contiguous rows, the same positions in each: a flat batch of B * T tokens, row-major
        positions = np.arange(start, end)
        attention: Attention = ContiguousAttention(cache, positions, batch, config, self.ops.compiled, self.dtype,
                                                   self.ops.batch_invariant)
        flat_positions = slice(start, end) if batch == 1 else np.tile(positions, batch)
        x = self.run_layers(ids.reshape(-1), flat_positions, attention).reshape(batch, num_new, -1)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.final_logits(x)
        if cache is not None:
            cache.commit(num_new)
        return ForwardOutput(logits=logits, cache=cache)

    def forward_batch(self, batch: BatchInput, pool: PagedKV) -> np.ndarray:
        """The engine's batched step: every scheduled token of every sequence, K/V in a block pool (new rows
        written through `batch.slot_mapping`). Returns logits [len(batch.logits_indices), vocab]."""
        attention = PagedAttention(pool, batch, self.config, self.ops.compiled, self.ops.batch_invariant, self.dtype)
        x = self.run_layers(np.asarray(batch.token_ids, dtype=np.int64), batch.positions, attention)
        return self.final_logits(x[np.asarray(batch.logits_indices, dtype=np.int64)])

    __call__ = forward

    def warm_up(self, kv_dtype: object = None) -> float:
        """Run a throwaway prefill (long enough for the BLAS path) and a decode step, so that a compiled
        backend's kernels for this model's dtypes are compiled (first run) or loaded from numba's disk
        cache now, not inside the first timed prefill. Returns the seconds it took; the model is unchanged."""
        import time

        start = time.perf_counter()
        if self.ops.compiled:
            # past the fused kernels' rows where prefill leaves them (q8 activations never do: 64 rows)
            length = min(self.ops.max_fused_rows + 1, 64, self.config.max_position_embeddings - 1)
            cache = self.new_cache(1, kv_dtype=kv_dtype, capacity=length + 1)
            self.forward(np.zeros((1, length), dtype=np.int64), cache=cache, logits_to_keep=1)
            self.forward(np.zeros((1, 1), dtype=np.int64), cache=cache)
        return time.perf_counter() - start

    # --- the two ends of a forward -------------------------------------------------------------------------
    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The residual stream of `ids`: a fresh array in the compute dtype, which blocks update in place."""
        if isinstance(self.embed, QuantizedMatrix):  # a quantized table: dequantize just these rows
            x = self.embed.dequantize(self.dtype, ids)
        else:
            x = self.embed[ids].astype(self.dtype, copy=False)  # fancy indexing made a fresh array
        if self.config.scale_embeddings:  # Gemma: times sqrt(hidden), rounded to float32 as transformers does
            x *= self.dtype.type(np.float32(np.sqrt(self.config.hidden_size)))
        return x

    def final_logits(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm and LM head over hidden states x [..., hidden] (soft-capped where Gemma 2 says)."""
        logits = self.ops.norm_linear(x, self.norm, self.lm_head)
        if self.config.final_logit_softcapping is not None:
            softcap(logits, self.config.final_logit_softcapping)
        return logits


class TinyLlama(LlamaModel):
    """The seeds' model: 2 layers, hidden 32, 4 query heads, 2 KV heads, head_dim 8, float64, fixed seed.

    `TinyLlama(seed=7)` always has the same weights. Config fields can be overridden (e.g. `causal=False`
    for the verifier's negative control, `num_key_value_heads=1` for MQA).
    """

    def __init__(self, seed: int = 0, dtype: object = np.float64, backend: str | None = None,
                 **config_changes: Any) -> None:
        super().__init__(tiny_config(**config_changes), dtype=dtype, seed=seed, backend=backend)
