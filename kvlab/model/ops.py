"""Seam 1, the math of a decoder block: `qkv_rope` before attention, `output_mlp` after it.

The model's one layer loop (LlamaModel.run_layers) runs over a flat batch of N tokens, x [N, hidden]:

    q, k, v = ops.qkv_rope(x, layer, rope)   # RMSNorm, fused q/k/v product (+ bias), RoPE on q and k
    o = attention(index, q, k, v)            # kvlab/model/attention.py: the only code that sees K/V storage
    ops.output_mlp(x, o, layer)              # output product + residual, RMSNorm, SwiGLU MLP + residual

An Ops class is one way of doing that math, chosen once when the model is built:

  * `NumpyOps`, the reference: the formulas of model/layers.py as written, NumPy only, no speed tricks;
  * `CompiledOps`, the numba kernels (kvlab/kernels/): a few rows (a decode step, up to MAX_KERNEL_ROWS
    tokens) go through the fused block kernels of kernels/decode_layer.py, two calls per layer that read
    bfloat16/float16 weights in place; more rows (a prefill) take the same products as BLAS calls on
    widened weights (kernels/gemv.py), where the work is compute rather than memory.

A new weight format or a torch backend is one more class with these methods. `bind` turns the model's
fused weights (model/llama.Layer) into whatever the class reads per layer (the compiled kernels take
half-precision matrices as raw bits), once per set of weights, so the loop does no per-step conversion.
`rope` is the pair (cos, sin) [N, d] of each token's rotation at its absolute position, sin sign-folded
([-sin, sin], see layers.rotate_halves).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

from kvlab.config import ModelConfig
from kvlab.model.layers import geglu, linear, rms_norm, rotate_halves, swiglu
from kvlab.model.quantized import QuantizedLinear

Rope = tuple[np.ndarray, np.ndarray]


class Ops(Protocol):
    """What the layer loop asks of a backend (shapes in the module docstring)."""

    compiled: bool  # whether attention may use the compiled kernels too

    def bind(self, layers: Sequence[Any]) -> list[Any]: ...

    def qkv_rope(self, x: np.ndarray, layer: Any, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def output_mlp(self, x: np.ndarray, o: np.ndarray, layer: Any) -> None: ...

    def norm_linear(self, x: np.ndarray, norm: np.ndarray, w: np.ndarray) -> np.ndarray: ...


class _Shapes:
    """Head counts, the RMSNorm epsilon and the MLP's activation every Ops class needs, and the block
    step by step over the class's own products (`_linear`, `norm_linear`): the reference's way, and
    the compiled classes' way for a layer the fused kernels do not cover (q/k norms, Gemma's norms after
    attention and MLP, GeGLU: model/llama.Layer.plain)."""

    def __init__(self, config: ModelConfig) -> None:
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.qk_heads = self.heads + self.kv_heads  # the heads RoPE rotates: q's and k's
        self.all_heads = self.qk_heads + self.kv_heads
        self.eps = config.rms_norm_eps
        self.activation = geglu if config.hidden_act == "gelu_pytorch_tanh" else swiglu
        self.fusable_mlp = config.hidden_act == "silu"  # the fused kernels' activation is SwiGLU

    def split(self, qkv: np.ndarray, qk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q [N, H_q, d], k [N, H_kv, d] from the rotated heads qk, v [N, H_kv, d] from qkv: views."""
        return qk[:, :self.heads], qk[:, self.heads:self.qk_heads], qkv[:, self.qk_heads:]

    def stepwise_qkv_rope(self, x: np.ndarray, layer: Any, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """RMSNorm, q/k/v product (+ bias), q/k norms per head (Qwen3, Gemma 3), RoPE on q and k."""
        qkv = self.norm_linear(x, layer.input_norm, layer.w_qkv, layer.b_qkv)
        qkv = qkv.reshape(x.shape[0], self.all_heads, self.head_dim)
        if layer.q_norm is not None:
            qkv[:, :self.heads] = rms_norm(qkv[:, :self.heads], layer.q_norm, self.eps)
            qkv[:, self.heads:self.qk_heads] = rms_norm(qkv[:, self.heads:self.qk_heads], layer.k_norm, self.eps)
        cos, sin = rope
        qk = rotate_halves(qkv[:, :self.qk_heads], cos[:, None], sin[:, None])  # one rotation over heads
        return self.split(qkv, qk)

    def stepwise_output_mlp(self, x: np.ndarray, o: np.ndarray, layer: Any) -> None:
        """Output product (+ bias; normed, Gemma), residual; RMSNorm, gated MLP (normed, Gemma), residual."""
        out = self._linear(o, layer.w_o, layer.b_o)
        if layer.attn_out_norm is not None:
            out = rms_norm(out, layer.attn_out_norm, self.eps)
        x += out
        gate_up = self.norm_linear(x, layer.post_norm, layer.w_gate_up)
        inter = gate_up.shape[-1] // 2
        down = self._linear(self.activation(gate_up[..., :inter], gate_up[..., inter:]), layer.w_down)
        if layer.mlp_out_norm is not None:
            down = rms_norm(down, layer.mlp_out_norm, self.eps)
        x += down


class NumpyOps(_Shapes):
    """The reference: each step is the formula from model/layers.py on whole arrays. `activations="q8"`
    rounds the input of every quantized product to int8 per group first (model/act_quant.py)."""

    compiled = False

    def __init__(self, config: ModelConfig, activations: str = "float32") -> None:
        super().__init__(config)
        self.activations = activations

    def bind(self, layers: Sequence[Any]) -> list[Any]:
        return list(layers)

    def _linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        # a quantized weight: tiles of its dequantized rows (the file's exact values) times x
        out = w.matmul_t(x, False, self.activations) if isinstance(w, QuantizedLinear) else linear(x, w)
        if bias is not None:
            out += bias
        return out

    def norm_linear(self, x: np.ndarray, norm: np.ndarray, w: np.ndarray,
                    bias: np.ndarray | None = None) -> np.ndarray:
        """rms_norm(x) @ w.T (+ bias): how a block opens its attention and its MLP, and the LM head."""
        return self._linear(rms_norm(x, norm, self.eps), w, bias)

    def qkv_rope(self, x: np.ndarray, layer: Any, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.stepwise_qkv_rope(x, layer, rope)

    def output_mlp(self, x: np.ndarray, o: np.ndarray, layer: Any) -> None:
        self.stepwise_output_mlp(x, o, layer)


class KernelLayer(NamedTuple):
    """A layer as the compiled kernels read it: the model's matrices (for the BLAS path) and their kernel
    views (half precision as raw bits, kernels/bits.py); an absent bias as None and as an empty array."""

    layer: Any
    qkv: np.ndarray
    b_qkv: np.ndarray
    o: np.ndarray
    b_o: np.ndarray
    gate_up: np.ndarray
    down: np.ndarray


class CompiledOps(_Shapes):
    """The numba kernels: fused block kernels for a few rows, BLAS on widened weights for many."""

    compiled = True

    def __init__(self, config: ModelConfig, dtype: np.dtype) -> None:
        super().__init__(config)
        from kvlab.kernels import decode_layer, gemv  # numba loads only for this backend

        self._gemv, self._fused = gemv, decode_layer
        self.max_fused_rows = gemv.MAX_KERNEL_ROWS  # the gemv kernels' own limit: above it BLAS wins
        self._empty = np.zeros(0, dtype=dtype)
        # scalars typed once: a decode step makes two kernel calls per layer, each a few microseconds
        self._eps, self._zero, self._half = dtype.type(self.eps), dtype.type(0), self.head_dim // 2

    def bind(self, layers: Sequence[Any]) -> list[Any]:
        """Kernel views of each plain layer; a layer with the families' extra steps (model/llama.Layer.plain)
        stays a Layer and goes step by step: compiled products, NumPy norms and activation between them."""
        view, empty = self._gemv.as_kernel_array, self._empty
        return [KernelLayer(layer, view(layer.w_qkv), empty if layer.b_qkv is None else layer.b_qkv,
                            view(layer.w_o), empty if layer.b_o is None else layer.b_o,
                            view(layer.w_gate_up), view(layer.w_down))
                if layer.plain and self.fusable_mlp else layer for layer in layers]

    def _linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        return self._gemv.linear(x, w, bias)

    def norm_linear(self, x: np.ndarray, norm: np.ndarray, w: np.ndarray,
                    bias: np.ndarray | None = None) -> np.ndarray:
        return self._gemv.norm_linear(x, norm, self.eps, w, bias)

    def qkv_rope(self, x: np.ndarray, layer: KernelLayer,
                 rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not isinstance(layer, KernelLayer):
            return self.stepwise_qkv_rope(x, layer, rope)
        rows, cos, sin = x.shape[0], *rope
        if rows <= self.max_fused_rows:  # norm, product, bias and RoPE in one call
            qkv = np.empty((rows, self.all_heads, self.head_dim), dtype=x.dtype)
            self._fused.qkv_rope(x, layer.layer.input_norm, self._eps, layer.qkv, layer.b_qkv,
                                 cos.reshape(rows, 2, self._half), sin.reshape(rows, 2, self._half),
                                 self.qk_heads, qkv.reshape(rows, -1), self._zero)
            return qkv[:, :self.heads], qkv[:, self.heads:self.qk_heads], qkv[:, self.qk_heads:]
        weights = layer.layer
        qkv = self.norm_linear(x, weights.input_norm, weights.w_qkv, weights.b_qkv)
        qkv = qkv.reshape(rows, self.all_heads, self.head_dim)
        return self.split(qkv, rotate_halves(qkv[:, :self.qk_heads], cos[:, None], sin[:, None]))

    def output_mlp(self, x: np.ndarray, o: np.ndarray, layer: KernelLayer) -> None:
        if not isinstance(layer, KernelLayer):
            self.stepwise_output_mlp(x, o, layer)
            return
        weights = layer.layer
        if x.shape[0] <= self.max_fused_rows:  # the rest of the block in one call
            self._fused.output_mlp(x, o, layer.o, layer.b_o, weights.post_norm, self._eps, layer.gate_up,
                                   layer.down, self._zero)
            return
        x += self._gemv.linear(o, weights.w_o, weights.b_o)
        gate_up = self.norm_linear(x, weights.post_norm, weights.w_gate_up)
        x += self._gemv.swiglu_linear(gate_up, weights.w_down)


class QuantizedLayer(NamedTuple):
    """A layer whose four matrices are QuantizedMatrix, as the fused kernels read them (kernels/qgemv.py's
    `kernel_args` tuples); an absent bias as an empty array."""

    layer: Any
    qkv: tuple
    b_qkv: np.ndarray
    o: tuple
    b_o: np.ndarray
    gate_up: tuple
    down: tuple


class QuantizedOps(CompiledOps):
    """Compiled products over quantized weights (GGUF blocks in the kernels' tiled layout, model/quantized.py).

    A few rows (decode) of a layer whose four matrices are all quantized take the fused block kernels of
    kernels/qdecode_layer.py, two calls per layer like CompiledOps; a layer that mixes in half-precision
    matrices (an F16 tensor beside Q8_0 ones) or matrices of different types stacked by rows (RowStack)
    takes the products one by one (kernels/qgemv.py), with RMSNorm compiled and RoPE, SwiGLU in NumPy
    between them. More rows (prefill): bands of dequantized rows and BLAS (QuantizedMatrix.matmul_t).
    `activations="q8"`: the same calls over the integer dot-product layout (kernels/qdot.py), and every
    other quantized product's input rounded alike (model/act_quant.py)."""

    def __init__(self, config: ModelConfig, dtype: np.dtype, activations: str = "float32") -> None:
        super().__init__(config, dtype)
        from kvlab.kernels import qdecode_layer, qgemv  # numba loads only for this backend

        self._qfused, self._kernel_args = qdecode_layer, qgemv.kernel_args
        self._dot_kernel_args = qgemv.dot_kernel_args
        self.activations = activations
        if activations == "q8":  # the integer products beat bands + BLAS at any row count: one path for all
            self.max_fused_rows = 1 << 62

    def bind(self, layers: Sequence[Any]) -> list[Any]:
        from kvlab.model.quantized import QuantizedMatrix

        def fusable(layer: Any) -> bool:
            return layer.plain and self.fusable_mlp and all(
                isinstance(w, QuantizedMatrix) for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))

        def args(w: Any) -> tuple:
            if self.activations == "q8":
                return self._dot_kernel_args(w.dot_layout, w.tail)
            return self._kernel_args(w.tiles, w.tail)

        empty = self._empty
        return [QuantizedLayer(layer, args(layer.w_qkv), empty if layer.b_qkv is None else layer.b_qkv,
                               args(layer.w_o), empty if layer.b_o is None else layer.b_o,
                               args(layer.w_gate_up), args(layer.w_down)) if fusable(layer) else layer
                for layer in layers]

    def _linear(self, x: np.ndarray, w: Any, bias: np.ndarray | None = None) -> np.ndarray:
        out = w.matmul_t(x, True, self.activations) if isinstance(w, QuantizedLinear) else self._gemv.linear(x, w)
        if bias is not None:
            out += bias
        return out

    def norm_linear(self, x: np.ndarray, norm: np.ndarray, w: Any,
                    bias: np.ndarray | None = None) -> np.ndarray:
        return self._linear(self._gemv.rms_norm(x, norm, self.eps), w, bias)

    def qkv_rope(self, x: np.ndarray, layer: Any, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows, cos, sin = x.shape[0], *rope
        if isinstance(layer, QuantizedLayer) and rows <= self.max_fused_rows:
            qkv = np.empty((rows, self.all_heads, self.head_dim), dtype=x.dtype)
            self._qfused.qkv_rope(x, layer.layer.input_norm, self._eps, layer.qkv, layer.b_qkv,
                                  cos.reshape(rows, 2, self._half), sin.reshape(rows, 2, self._half),
                                  self.qk_heads, qkv.reshape(rows, -1), self._zero)
            return qkv[:, :self.heads], qkv[:, self.heads:self.qk_heads], qkv[:, self.qk_heads:]
        return self.stepwise_qkv_rope(x, getattr(layer, "layer", layer), rope)

    def output_mlp(self, x: np.ndarray, o: np.ndarray, layer: Any) -> None:
        if isinstance(layer, QuantizedLayer) and x.shape[0] <= self.max_fused_rows:
            self._qfused.output_mlp(x, np.ascontiguousarray(o), layer.o, layer.b_o, layer.layer.post_norm,
                                    self._eps, layer.gate_up, layer.down, self._zero)
            return
        self.stepwise_output_mlp(x, o, getattr(layer, "layer", layer))


def make_ops(backend: str, config: ModelConfig, dtype: np.dtype, quantized: bool = False,
             activations: str = "float32") -> NumpyOps | CompiledOps:
    """The Ops class of a resolved backend name ("numba" or "numpy", see kernels.resolve_backend) for the
    model's weights: float (any float dtype) or `quantized` (GGUF block types kept as stored), with the
    quantized products' inputs exact ("float32") or rounded to int8 ("q8", model/act_quant.py)."""
    if backend != "numba":
        return NumpyOps(config, activations)
    return QuantizedOps(config, dtype, activations) if quantized else CompiledOps(config, dtype)
