"""The Llama-family decoder: embed -> blocks (attention, SwiGLU MLP) -> norm -> head.

One forward pass handles prefill, chunked prefill and decode alike: `ids` are the new positions, which
start at the cache's num_cached_tokens. Weights are fused on load (q/k/v into one matrix, gate/up into
another), laid out for the fastest matrix-vector product (see _Layer) and packed in one buffer in the
order a step reads them. A one-token step (decode) takes `_decode_blocks`, the same math as `_blocks`
in fewer NumPy calls, because at batch 1 everything between the weight reads is call overhead;
`model.fast_decode = False` switches it off for comparison (tests/test_hf_fast_decode.py).

Two backends, one model: `backend="numpy"` is the reference (the math as on the page, NumPy only);
`"numba"` (the default where numba imports) runs the projections, norms and decode attention as compiled
kernels (kvlab/kernels/) that read bfloat16/float16 weights and caches in place and compute in float32.
Weight matrices keep their checkpoint precision when `weights_dtype="auto"`: a bfloat16 file streams half
the bytes per step, and its logits still equal a float32 run of the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from kvlab import validate
from kvlab.cache.base import CacheSpec
from kvlab.cache.contiguous import MIN_CAPACITY
from kvlab.cache.kv_cache import KVCache
from kvlab.config import ModelConfig, tiny_config
from kvlab.errors import ContextLengthError, InputError
from kvlab.kernels import resolve_backend
from kvlab.model.layers import attend, attention_mask, linear, rms_norm, rope_inv_freq, rotate_halves, swiglu
from kvlab.model.weights import check_weights, fingerprint, random_weights, resolve_weights_dtype


@dataclass
class ForwardOutput:
    """logits [B, T_new (or logits_to_keep), vocab] and the cache that now holds the new positions."""

    logits: np.ndarray
    cache: KVCache | None


@dataclass
class _Layer:
    """One block's weights. Matrices are [out, in] (HF's layout, used as `x @ w.T`) in the storage dtype
    (float32, or bfloat16/float16 as the checkpoint has them): each output is a dot product over one
    contiguous row, the layout the compiled gemv streams fastest. Norms and biases are in the compute dtype."""

    input_norm: np.ndarray
    w_qkv: np.ndarray          # [(H_q + 2 H_kv) d, hidden]
    b_qkv: np.ndarray | None
    w_o: np.ndarray            # [hidden, H_q d]
    b_o: np.ndarray | None
    post_norm: np.ndarray
    w_gate_up: np.ndarray      # [2 intermediate, hidden]
    w_down: np.ndarray         # [hidden, intermediate]


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
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        where = tuple(int(i) for i in np.argwhere(array == bad)[0])
        raise InputError(f"token id {bad} at {where} is outside the vocabulary [0, {vocab_size})")
    return array.astype(np.int64, copy=False)


class LlamaModel:
    """A Llama / Mistral / Qwen2 decoder in NumPy. `forward(ids, cache=..., use_cache=...)`."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray] | None = None,
                 dtype: object = np.float32, seed: int = 0, source: str = "weights",
                 weights_dtype: object = None, backend: str | None = None) -> None:
        """`weights_dtype`: None (cast to `dtype`), "auto" (keep a half-precision checkpoint as stored),
        or "float16"/"bfloat16"; `backend`: None/"auto" (compiled where available), "numba" or "numpy"."""
        self.config = config
        if not isinstance(config, ModelConfig):
            raise InputError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.dtype = validate.compute_dtype(dtype)
        self.backend = resolve_backend(backend)
        self.weights_dtype_request = weights_dtype
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, self.dtype)
        self._cos = self._sin = np.zeros((0, config.head_dim), dtype=self.dtype)
        self.fast_decode = True  # one-token steps take _decode_blocks (False: the general path, to compare)
        self.set_weights(weights if weights is not None else random_weights(config, seed, self.dtype), source)
        if self.backend == "numba":
            from kvlab.kernels import attention, decode_layer, gemv, prefill_attention
            self._gemv, self._attention, self._prefill = gemv, attention, prefill_attention
            self._decode_layer = decode_layer

    # --- weights -----------------------------------------------------------------------------------------
    def set_weights(self, weights: Mapping[str, np.ndarray], source: str = "weights") -> None:
        """Check, cast, fingerprint and fuse a state dict with HF names. Caches made before are refused."""
        check_weights(self.config, weights, source)
        used = {name: array for name, array in weights.items() if not name.endswith("inv_freq")}
        if self.config.tie_word_embeddings:
            used.pop("lm_head.weight", None)
        self.weights_dtype = resolve_weights_dtype(self.weights_dtype_request, self.dtype, used, source)
        cast = {name: np.ascontiguousarray(array, dtype=self.weights_dtype if array.ndim == 2 else self.dtype)
                for name, array in used.items()}
        self._fingerprint = fingerprint(self.config, self.dtype, cast)
        self.embed = cast["model.embed_tokens.weight"]
        self.norm = cast["model.norm.weight"]
        self.lm_head = self.embed if self.config.tie_word_embeddings else cast["lm_head.weight"]  # [vocab, hidden]
        self.layers = self._fuse_layers(cast)

    def _fuse_layers(self, cast: Mapping[str, np.ndarray]) -> list[_Layer]:
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
                part = cast[f"{attn}{x}_proj.weight"]
                w_qkv[row:row + part.shape[0]] = part
                row += part.shape[0]
            w_o[...] = cast[attn + "o_proj.weight"]
            w_gate_up[:c.intermediate_size] = cast[mlp + "gate_proj.weight"]
            w_gate_up[c.intermediate_size:] = cast[mlp + "up_proj.weight"]
            w_down[...] = cast[mlp + "down_proj.weight"]
            has_bias = cast.get(attn + "q_proj.bias") is not None
            layers.append(_Layer(
                input_norm=cast[p + "input_layernorm.weight"], w_qkv=w_qkv,
                b_qkv=np.concatenate([cast[f"{attn}{x}_proj.bias"] for x in "qkv"]) if has_bias else None,
                w_o=w_o, b_o=cast.get(attn + "o_proj.bias"), post_norm=cast[p + "post_attention_layernorm.weight"],
                w_gate_up=w_gate_up, w_down=w_down))
        return layers

    @property
    def fingerprint(self) -> str:
        """SHA-256 of config, dtype and weights, computed once per `set_weights` (never per step)."""
        return self._fingerprint

    @property
    def cache_spec(self) -> CacheSpec:
        c = self.config
        return CacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype, self._fingerprint)

    def new_cache(self, batch_size: int = 1, kv_dtype: object = None, capacity: int = MIN_CAPACITY) -> KVCache:
        """An empty cache for this model; `capacity` preallocates that many positions."""
        return KVCache(self.cache_spec, batch_size, kv_dtype, capacity)

    # --- forward -----------------------------------------------------------------------------------------
    def _rope_tables(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sign-folded sin ([-sin, sin]) for positions [0, end), grown by doubling: decode only slices."""
        if self._cos.shape[0] < end:
            size = min(max(end, 2 * self._cos.shape[0], 256), max(end, self.config.max_position_embeddings))
            angles = np.arange(size).astype(self.dtype)[:, None] * self.inv_freq
            angles = np.concatenate([angles, angles], axis=-1)
            sin = np.sin(angles)
            sin[:, : angles.shape[1] // 2] *= -1  # sign-folded for rotate_halves
            self._cos, self._sin = np.cos(angles), sin
        return self._cos, self._sin

    def forward(self, ids: Any, cache: KVCache | None = None, use_cache: bool = False,
                logits_to_keep: int = 0) -> ForwardOutput:
        """Run the new positions `ids` [B, T_new]; with a cache they continue from it and are appended.

        `logits_to_keep=k` returns logits for the last k positions only (0 = all), which spares the LM-head
        matmul over a long prompt during generation. Everything is validated before the cache is touched.
        """
        config = self.config
        ids = validate_ids(ids, config.vocab_size)
        batch, num_new = ids.shape
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise InputError(f"cache must be a KVCache, got {type(cache).__name__}")
            cache.check_compatible(self.cache_spec, batch)
        start = cache.get_seq_length() if cache is not None else 0
        end = start + num_new
        if end > config.max_position_embeddings:
            raise ContextLengthError(
                f"positions {start}..{end - 1} exceed the model's context of "
                f"{config.max_position_embeddings} tokens (max_position_embeddings)")
        if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) \
                or logits_to_keep < 0:
            raise InputError(f"logits_to_keep must be a non-negative int, got {logits_to_keep!r}")
        if cache is None and use_cache:
            cache = self.new_cache(batch, capacity=max(end, MIN_CAPACITY))

        positions = np.arange(start, end)
        cos, sin = self._rope_tables(end)
        cos, sin = cos[start:end, None], sin[start:end, None]  # [T, 1, d]: broadcast over heads

        x = self.embed_tokens(ids)  # a fresh [B, T, hidden] array: the residual stream, updated in place
        with np.errstate(over="ignore"):  # swiglu's exp(-gate) may overflow to inf: correct, and silent
            observed = getattr(cache, "observer", None) is not None  # it needs q: the general path has it
            first_key = self._decode_key_start(start, cache) \
                if num_new == 1 and self.fast_decode and not observed else None
            if first_key is None:
                self._blocks(x, positions, cos, sin, cache)
            else:
                self._decode_blocks(x, positions, cos, sin, cache, first_key)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.final_logits(x)
        if cache is not None:
            cache.commit(num_new)
        return ForwardOutput(logits=logits, cache=cache)

    def _blocks(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                cache: KVCache | None) -> None:
        """Run every decoder block on the residual stream x [B, T, hidden], in place."""
        config = self.config
        batch, num_new = x.shape[:2]
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        qk_heads = heads + kv_heads
        mask, ranges, observer = None, None, getattr(cache, "observer", None)
        # The compiled kernel reads the cache where it lies (any float dtype) and splits over both cores;
        # an observer (H2O) needs the scores, which only the NumPy path materialises.
        compiled = self.backend == "numba" and observer is None and (cache is None or cache.in_place)
        for index, layer in enumerate(self.layers):
            qkv = self._qkv(x, layer).reshape(batch, num_new, qk_heads + kv_heads, head_dim)
            qk = rotate_halves(qkv[:, :, :qk_heads], cos, sin)  # RoPE on q and k heads together: [B, T, H_q+H_kv, d]
            q = qk[:, :, :heads].transpose(0, 2, 1, 3)
            k = qk[:, :, heads:].transpose(0, 2, 1, 3)
            v = qkv[:, :, qk_heads:].transpose(0, 2, 1, 3)
            if compiled and cache is not None:
                k, v = cache.append(index, k, v, positions)  # whole storage arrays; rows < end are valid
                key_positions = np.append(cache.positions, positions)
            elif cache is not None:
                k, v, key_positions = cache.update(index, k, v, positions)
            else:
                key_positions = positions
            if index == 0:  # positions are the same in every layer: build the mask once per forward
                mask = attention_mask(positions, key_positions, causal=config.causal,
                                      sliding_window=config.sliding_window)
                if compiled:
                    ranges = self._prefill.key_ranges(mask, batch, num_new, len(key_positions))
            if ranges is not None:
                attn = self._prefill.prefill_attention(q, k, v, *ranges)
            else:
                if compiled:  # a mask the kernel cannot take (some row's keys are not one run)
                    end = len(key_positions)
                    k, v = k[:, :, :end].astype(self.dtype), v[:, :, :end].astype(self.dtype)
                attn = attend(q, k, v, mask)
            if observer is not None:  # e.g. H2O's attention scores
                observer(index, q, k, mask)
            self._finish_block(x, layer, attn.transpose(0, 2, 1, 3).reshape(batch, num_new, heads * head_dim))

    def _decode_key_start(self, position: int, cache: KVCache | None) -> int | None:
        """For a one-token step: the index of the first key it may see, if the visible keys are exactly the
        cached rows from there on plus itself (always so with causal attention and a sliding window);
        None when the mask is anything else, and the general path must run."""
        if cache is None or (self.config.causal and self.config.sliding_window is None):
            return 0  # cached rows sit at positions 0..position-1: a causal step without a window sees all
        key_positions = np.append(cache.positions, position)
        mask = attention_mask(np.array([position]), key_positions, causal=self.config.causal,
                              sliding_window=self.config.sliding_window)
        if mask is None:
            return 0
        visible = np.flatnonzero(mask[0])
        if visible.size == 0 or visible[-1] != len(key_positions) - 1 \
                or visible.size != len(key_positions) - visible[0]:
            return None
        return int(visible[0])

    def _decode_blocks(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                       cache: KVCache | None, first_key: int) -> None:
        """`_blocks` for one new position per row (x [B, 1, hidden]): the decode step.

        The same math as `_blocks`, in as few NumPy calls as it takes: at batch 1 a step is a chain of
        small matrix-vector products, and everything between them is Python and NumPy call overhead
        (made worse by each product streaming megabytes of weights through the CPU caches). So: plain
        views instead of head transposes, RoPE on q and k at once, the mask reduced to a key range
        (`first_key`), and a softmax normalised after the value product ([G, d] rather than [G, T]).
        """
        config = self.config
        batch, hidden = x.shape[0], x.shape[2]
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        group, qk_heads, half = heads // kv_heads, heads + kv_heads, head_dim // 2
        scale = x.dtype.type(1.0 / math.sqrt(head_dim))
        cos, sin = cos.reshape(2, half), sin.reshape(2, half)  # this position's rotation
        x = x.reshape(batch, hidden)  # a view: updating it updates the caller's residual stream
        if self.backend == "numba" and (cache is None or cache.in_place):
            self._decode_blocks_compiled(x, positions, cos, sin, cache, first_key, scale)
            return
        for index, layer in enumerate(self.layers):
            qkv = self._qkv(x, layer).reshape(batch, qk_heads + kv_heads, 2, half)
            qk = qkv[:, :qk_heads]
            rotated = qk * cos
            rotated += qk[:, :, ::-1] * sin  # rotate_halves: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]
            k = rotated[:, heads:].reshape(batch, kv_heads, 1, head_dim)
            v = qkv[:, qk_heads:].reshape(batch, kv_heads, 1, head_dim)
            if cache is not None:
                k, v, _ = cache.update(index, k, v, positions)
                if first_key:
                    k, v = k[:, :, first_key:], v[:, :, first_key:]
            # scores = K q^T with q^T contiguous ([B, H_kv, d, G]): see layers._attend_block
            q_t = np.multiply(rotated[:, :heads].reshape(batch, kv_heads, group, head_dim).swapaxes(-1, -2),
                              scale, order="C")
            weights = np.swapaxes(k @ q_t, -1, -2).copy()  # [B, H_kv, G, T]
            weights -= np.maximum.reduce(weights, axis=-1, keepdims=True)
            np.exp(weights, out=weights)
            attn = weights @ v  # [B, H_kv, G, d], unnormalised
            attn /= np.add.reduce(weights, axis=-1, keepdims=True)
            self._finish_block(x, layer, attn.reshape(batch, heads * head_dim))

    def _decode_blocks_compiled(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                                cache: KVCache | None, first_key: int, scale: np.floating) -> None:
        """`_decode_blocks` on the compiled backend: three kernel calls per block (kernels/decode_layer.py)
        around the cache write, attention reading the cache where it lies (any float dtype)."""
        config = self.config
        batch = x.shape[0]
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        qk_heads = heads + kv_heads
        zero, eps = x.dtype.type(0), x.dtype.type(config.rms_norm_eps)
        layer_kernels, attention = self._decode_layer, self._attention
        end = 1 if cache is None else cache.get_seq_length() + 1
        starts, ends = np.full(batch, first_key, dtype=np.int64), np.full(batch, end, dtype=np.int64)
        tables = np.arange(batch, dtype=np.int64)[:, None]  # a contiguous cache: one block per sequence
        attend = attention.decode_kernel(batch * kv_heads * (end - first_key))
        qkv = np.empty((batch, (qk_heads + kv_heads) * head_dim), dtype=x.dtype)
        attn = np.empty((batch, heads, head_dim), dtype=x.dtype)
        for index, (layer, w) in enumerate(zip(self.layers, self._kernel_weights)):
            layer_kernels.qkv_rope(x, layer.input_norm, eps, w["qkv"], w["b_qkv"], cos, sin, qk_heads, qkv, zero)
            k = qkv[:, heads * head_dim:qk_heads * head_dim].reshape(batch, kv_heads, 1, head_dim)
            v = qkv[:, qk_heads * head_dim:].reshape(batch, kv_heads, 1, head_dim)
            if cache is not None:
                k, v = cache.append(index, k, v, positions)  # rounded to the cache dtype, as on every path
            q = qkv[:, :heads * head_dim].reshape(batch, heads, head_dim) * scale
            attend(q, self._gemv.as_kernel_array(k), self._gemv.as_kernel_array(v), tables, starts, ends,
                   attention.SPAN, attn, zero)
            layer_kernels.output_mlp(x, attn.reshape(batch, heads * head_dim), w["o"], w["b_o"], layer.post_norm,
                                     eps, w["gate_up"], w["down"], zero)

    @property
    def _kernel_weights(self) -> list[dict[str, np.ndarray]]:
        """Per layer, the views the compiled kernels take (half-precision as raw bits; an absent bias as an
        empty array), made once per set of weights."""
        if getattr(self, "_kernel_views", None) is None or self._kernel_views[0] is not self.layers:
            as_kernel_array, empty = self._gemv.as_kernel_array, np.zeros(0, dtype=self.dtype)
            views = [{"qkv": as_kernel_array(layer.w_qkv), "o": as_kernel_array(layer.w_o),
                      "gate_up": as_kernel_array(layer.w_gate_up), "down": as_kernel_array(layer.w_down),
                      "b_qkv": empty if layer.b_qkv is None else layer.b_qkv,
                      "b_o": empty if layer.b_o is None else layer.b_o} for layer in self.layers]
            self._kernel_views = (self.layers, views)
        return self._kernel_views[1]

    def warm_up(self, kv_dtype: object = None) -> float:
        """Run a throwaway prefill (long enough for the BLAS path) and a decode step, so that a compiled
        backend's kernels for this model's dtypes are compiled (first run) or loaded from numba's disk
        cache now, not inside the first timed prefill. Returns the seconds it took; the model is unchanged."""
        import time

        start = time.perf_counter()
        if self.backend == "numba":
            length = min(self._gemv.MAX_KERNEL_ROWS + 1, self.config.max_position_embeddings - 1)
            cache = self.new_cache(1, kv_dtype=kv_dtype, capacity=length + 1)
            self.forward(np.zeros((1, length), dtype=np.int64), cache=cache, logits_to_keep=1)
            self.forward(np.zeros((1, 1), dtype=np.int64), cache=cache)
        return time.perf_counter() - start

    # --- the products: NumPy reference or compiled kernels -----------------------------------------------
    def _linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """x @ w.T (+ bias) for a weight matrix w [out, in] in its storage dtype."""
        if self.backend == "numba":
            return self._gemv.linear(x, w, bias)
        out = linear(x, w)
        if bias is not None:
            out += bias
        return out

    def _norm_linear(self, x: np.ndarray, norm: np.ndarray, w: np.ndarray,
                     bias: np.ndarray | None = None) -> np.ndarray:
        """rms_norm(x) @ w.T (+ bias): how every block opens its attention and its MLP, and the LM head."""
        eps = self.config.rms_norm_eps
        if self.backend == "numba":
            return self._gemv.norm_linear(x, norm, eps, w, bias)
        return self._linear(rms_norm(x, norm, eps), w, bias)

    def _qkv(self, x: np.ndarray, layer: _Layer) -> np.ndarray:
        """The fused q/k/v projection of the normalised residual stream (one matmul)."""
        return self._norm_linear(x, layer.input_norm, layer.w_qkv, layer.b_qkv)

    def _finish_block(self, x: np.ndarray, layer: _Layer, attn: np.ndarray) -> None:
        """Output projection of the merged heads `attn` [..., H_q d], then the SwiGLU MLP; x updated in place."""
        x += self._linear(attn, layer.w_o, layer.b_o)
        gate_up = self._norm_linear(x, layer.post_norm, layer.w_gate_up)
        if self.backend == "numba":
            x += self._gemv.swiglu_linear(gate_up, layer.w_down)
            return
        inter = gate_up.shape[-1] // 2
        x += self._linear(swiglu(gate_up[..., :inter], gate_up[..., inter:]), layer.w_down)

    __call__ = forward

    # --- the two ends of a forward, for the batched engine step (kvlab/model/batch.py) ---------------------
    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The residual stream of `ids`: a fresh array in the compute dtype, which blocks update in place."""
        return self.embed[ids].astype(self.dtype, copy=False)

    def final_logits(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm and LM head over hidden states x [..., hidden]."""
        return self._norm_linear(x, self.norm, self.lm_head)


class TinyLlama(LlamaModel):
    """The seeds' model: 2 layers, hidden 32, 4 query heads, 2 KV heads, head_dim 8, float64, fixed seed.

    `TinyLlama(seed=7)` always has the same weights. Config fields can be overridden (e.g. `causal=False`
    for the verifier's negative control, `num_key_value_heads=1` for MQA).
    """

    def __init__(self, seed: int = 0, dtype: object = np.float64, backend: str | None = None,
                 **config_changes: Any) -> None:
        super().__init__(tiny_config(**config_changes), dtype=dtype, seed=seed, backend=backend)
