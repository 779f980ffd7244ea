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
    widened weights (kernels/gemv.py), where the work is compute rather than memory. A decode step whose
    attention can run inside the call too (`block_fuses`, and the attention's `fused_step`) makes one
    call per layer: `decode_block` (kernels/decode_block.py), the two calls and attention between them.

The two halves of a block fuse apart. `qkv_rope` fuses for every family: the kernels take the per-head
q/k norms (Qwen3, Gemma 3) between the product and RoPE, and partial rotary (Phi-3) and NoPE (SmolLM3)
are only other RoPE tables (model/rope.py). `output_mlp` fuses where the MLP half is Llama's
(model/llama.Layer.plain_mlp and SwiGLU: Llama, Qwen2/3, Mistral, Phi-3, SmolLM3); Gemma's norms after
attention and MLP and its GeGLU take that half step by step (`stepwise_output_mlp`).

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
    # whether every row's products are independent of the rows beside it, bit for bit (so attention must
    # be too: model/attention.py then runs prefill through the decode kernel, one query row at a time)
    batch_invariant: bool

    def bind(self, layers: Sequence[Any]) -> list[Any]: ...

    def qkv_rope(self, x: np.ndarray, layer: Any, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def output_mlp(self, x: np.ndarray, o: np.ndarray, layer: Any) -> None: ...

    def norm_linear(self, x: np.ndarray, norm: np.ndarray, w: np.ndarray) -> np.ndarray: ...


class _Shapes:
    """Head counts, the RMSNorm epsilon and the MLP's activation every Ops class needs, and the block
    step by step over the class's own products (`_linear`, `norm_linear`): the reference's way, and
    the compiled classes' way for a half the fused kernels do not cover (Gemma's norms after attention
    and MLP, GeGLU: model/llama.Layer.plain_mlp; a quantized layer mixing in float matrices)."""

    def __init__(self, config: ModelConfig) -> None:
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.qk_heads = self.heads + self.kv_heads  # the heads RoPE rotates: q's and k's
        self.all_heads = self.qk_heads + self.kv_heads
        self.eps = config.rms_norm_eps
        self.activation = geglu if config.hidden_act == "gelu_pytorch_tanh" else swiglu
        self.fusable_mlp = config.hidden_act == "silu"  # the fused kernels' activation is SwiGLU

    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """RMSNorm over the last axis (the stepwise halves' norms; the compiled classes compile it)."""
        return rms_norm(x, weight, self.eps)

    def gated(self, gate_up: np.ndarray) -> np.ndarray:
        """The gated MLP's activation (SwiGLU or GeGLU) over the halves of gate_up."""
        inter = gate_up.shape[-1] // 2
        return self.activation(gate_up[..., :inter], gate_up[..., inter:])

    def split(self, qkv: np.ndarray, qk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q [N, H_q, d], k [N, H_kv, d] from the rotated heads qk, v [N, H_kv, d] from qkv: views."""
        return qk[:, :self.heads], qk[:, self.heads:self.qk_heads], qkv[:, self.qk_heads:]

    def stepwise_qkv_rope(self, x: np.ndarray, layer: Any, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """RMSNorm, q/k/v product (+ bias), q/k norms per head (Qwen3, Gemma 3), RoPE on q and k."""
        qkv = self.norm_linear(x, layer.input_norm, layer.w_qkv, layer.b_qkv)
        qkv = qkv.reshape(x.shape[0], self.all_heads, self.head_dim)
        if layer.q_norm is not None:
            qkv[:, :self.heads] = self.norm(qkv[:, :self.heads], layer.q_norm)
            qkv[:, self.heads:self.qk_heads] = self.norm(qkv[:, self.heads:self.qk_heads], layer.k_norm)
        cos, sin = rope
        qk = rotate_halves(qkv[:, :self.qk_heads], cos[:, None], sin[:, None])  # one rotation over heads
        return self.split(qkv, qk)

    def stepwise_output_mlp(self, x: np.ndarray, o: np.ndarray, layer: Any) -> None:
        """Output product (+ bias; normed, Gemma), residual; RMSNorm, gated MLP (normed, Gemma), residual."""
        out = self._linear(o, layer.w_o, layer.b_o)
        if layer.attn_out_norm is not None:
            out = self.norm(out, layer.attn_out_norm)
        x += out
        gate_up = self.norm_linear(x, layer.post_norm, layer.w_gate_up)
        down = self._linear(self.gated(gate_up), layer.w_down)
        if layer.mlp_out_norm is not None:
            down = self.norm(down, layer.mlp_out_norm)
        x += down


class NumpyOps(_Shapes):
    """The reference: each step is the formula from model/layers.py on whole arrays. `activations="q8"`
    rounds the input of every quantized product to int8 per group first (model/act_quant.py)."""

    compiled = False
    batch_invariant = False

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
    views (half precision as raw bits, kernels/bits.py); an absent bias or q/k norm as None and as an
    empty array; `fused_mlp`: whether `output_mlp` takes the fused kernel (else step by step)."""

    layer: Any
    qkv: np.ndarray
    b_qkv: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    o: np.ndarray
    b_o: np.ndarray
    gate_up: np.ndarray
    down: np.ndarray
    fused_mlp: bool


class CompiledOps(_Shapes):
    """The numba kernels: fused block kernels for a few rows, BLAS on widened weights for many."""

    compiled = True
    batch_invariant = False  # a prefill's BLAS products sum in another order than a decode's fused kernels
    fuse_decode = True  # a decode step's block in one call where it can (`block_fuses`)

    def __init__(self, config: ModelConfig, dtype: np.dtype) -> None:
        super().__init__(config)
        from kvlab.kernels import decode_layer, gemv  # numba loads only for this backend
        from kvlab.kernels.decode_block import decode_block

        self._gemv, self._fused, self._decode_block = gemv, decode_layer, decode_block
        self.max_fused_rows = gemv.MAX_KERNEL_ROWS  # the gemv kernels' own limit: above it BLAS wins
        self._empty = np.zeros(0, dtype=dtype)
        # scalars typed once: a decode step makes one to three kernel calls per layer, each a few microseconds
        self._eps, self._zero, self._half = dtype.type(self.eps), dtype.type(0), self.head_dim // 2
        # The one call is a speed path, for float32. A float64 model (the exact reference: the seeds'
        # TinyLlama, `kvlab verify`) takes the three calls, which give the same bits, and is spared a cold
        # compile of the one-call block (~30 s per pool kind) that would buy its users nothing they measure.
        self._one_call = np.dtype(dtype) == np.float32
        self._last_halves: tuple[Rope, tuple[np.ndarray, np.ndarray]] | None = None  # `_halves`'

    def bind(self, layers: Sequence[Any]) -> list[Any]:
        """Kernel views of each layer: its attention half always fuses (q/k norms included); its MLP half
        fuses where it is Llama's (model/llama.Layer.plain_mlp, SwiGLU), else it goes step by step:
        compiled products, NumPy norms and activation between them."""
        view, vector = self._gemv.as_kernel_array, self._vector
        return [KernelLayer(layer, view(layer.w_qkv), vector(layer.b_qkv), vector(layer.q_norm),
                            vector(layer.k_norm), view(layer.w_o), vector(layer.b_o), view(layer.w_gate_up),
                            view(layer.w_down), layer.plain_mlp and self.fusable_mlp) for layer in layers]

    def block_fuses(self, layer: Any, rows: int) -> bool:
        """Whether `decode_block` can run this layer's block over `rows` decode rows in one call: both halves
        fuse (the MLP is Llama's), the rows are few enough for the fused kernels and the model computes in
        float32. False while `fuse_decode` is off (benches time the three calls apart; tests compare the two
        ways)."""
        return layer.fused_mlp and self._fuses(rows)

    def _fuses(self, rows: int) -> bool:
        """What every Ops' `block_fuses` asks besides the layer: fusion on, float32, few enough rows."""
        return self.fuse_decode and self._one_call and rows <= self.max_fused_rows

    def decode_block(self, x: np.ndarray, layer: Any, rope: Rope, attention: tuple) -> None:
        """A decode step's whole block in one call (kernels/decode_block.py), where `block_fuses`:
        `qkv_rope`, the attention whose operands `attention` holds (model/attention.py `fused_step`) and
        `output_mlp`, x updated in place, with the bits the three calls give."""
        self._decode_block(x, layer.layer.input_norm, self._eps, layer.qkv, layer.b_qkv, layer.q_norm,
                           layer.k_norm, self.heads, *self._halves(rope, x.shape[0]), self.qk_heads, self._zero,
                           attention, layer.o, layer.b_o, layer.layer.post_norm, layer.gate_up, layer.down)

    def _halves(self, rope: Rope, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) [rows, d] as the fused kernels take them: [rows, 2, d/2], each half's angles (views);
        the last rope's kept, as every layer of a step asks for the same one."""
        last = self._last_halves
        if last is not None and last[0] is rope:
            return last[1]
        cos, sin = rope
        halves = cos.reshape(rows, 2, self._half), sin.reshape(rows, 2, self._half)
        self._last_halves = (rope, halves)
        return halves

    def _vector(self, vector: np.ndarray | None) -> np.ndarray:
        """A bias or norm as the kernels take it: an absent one as an empty array."""
        return self._empty if vector is None else vector

    def _fused_qkv_rope(self, kernel: Any, x: np.ndarray, layer: Any, weights: Any,
                        rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`kernel.qkv_rope` (float or quantized) over a few rows: norm, product, bias, q/k norms and RoPE
        in one call."""
        rows = x.shape[0]
        qkv = np.empty((rows, self.all_heads, self.head_dim), dtype=x.dtype)
        kernel.qkv_rope(x, layer.layer.input_norm, self._eps, weights, layer.b_qkv, layer.q_norm, layer.k_norm,
                        self.heads, *self._halves(rope, rows), self.qk_heads, qkv.reshape(rows, -1), self._zero)
        return qkv[:, :self.heads], qkv[:, self.heads:self.qk_heads], qkv[:, self.qk_heads:]

    def _linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        return self._gemv.linear(x, w, bias)

    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """Compiled, row by row: the same bits for a row whatever rows run beside it."""
        return self._gemv.rms_norm(x, weight, self.eps)

    def gated(self, gate_up: np.ndarray) -> np.ndarray:
        return self._gemv.gated(gate_up, self.activation is geglu)

    def norm_linear(self, x: np.ndarray, norm: np.ndarray, w: np.ndarray,
                    bias: np.ndarray | None = None) -> np.ndarray:
        return self._gemv.norm_linear(x, norm, self.eps, w, bias)

    def qkv_rope(self, x: np.ndarray, layer: KernelLayer,
                 rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if x.shape[0] <= self.max_fused_rows:
            return self._fused_qkv_rope(self._fused, x, layer, layer.qkv, rope)
        return self.stepwise_qkv_rope(x, layer.layer, rope)  # BLAS products on widened weights

    def output_mlp(self, x: np.ndarray, o: np.ndarray, layer: KernelLayer) -> None:
        weights = layer.layer
        if not layer.fused_mlp:
            self.stepwise_output_mlp(x, o, weights)
            return
        if x.shape[0] <= self.max_fused_rows:  # the rest of the block in one call
            self._fused.output_mlp(x, o, layer.o, layer.b_o, weights.post_norm, self._eps, layer.gate_up,
                                   layer.down, self._zero)
            return
        x += self._gemv.linear(o, weights.w_o, weights.b_o)
        gate_up = self.norm_linear(x, weights.post_norm, weights.w_gate_up)
        x += self._gemv.swiglu_linear(gate_up, weights.w_down)


class QuantizedLayer(NamedTuple):
    """A layer as the fused kernels read its QuantizedMatrix weights (kernels/qgemv.py's `kernel_args`
    tuples); an absent bias or q/k norm as an empty array. `qkv` is None where w_qkv is not one
    QuantizedMatrix (that half goes step by step), `o`, `gate_up` and `down` None where the MLP half
    does not fuse."""

    layer: Any
    qkv: tuple | None
    b_qkv: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    o: tuple | None
    b_o: np.ndarray
    gate_up: tuple | None
    down: tuple | None


class QuantizedOps(CompiledOps):
    """Compiled products over quantized weights (GGUF blocks in the kernels' tiled layout, model/quantized.py).

    A few rows (decode) take the fused block kernels of kernels/qdecode_layer.py, two calls per layer like
    CompiledOps, each half where its matrices are quantized (q/k/v: one QuantizedMatrix, or up to three of
    different types stacked by rows, a RowStack, each its own product inside the call; o, gate/up, down
    all quantized and the MLP Llama's); a half that mixes in half-precision matrices (an F16 tensor beside
    Q8_0 ones) takes the products one by one (kernels/qgemv.py), with RMSNorm compiled and RoPE, SwiGLU in
    NumPy between them. More rows
    (prefill): bands of dequantized rows and BLAS (QuantizedMatrix.matmul_t).
    `activations="q8"`: the same calls over the integer dot-product layout (kernels/qdot.py), and every
    other quantized product's input rounded alike (model/act_quant.py)."""

    def __init__(self, config: ModelConfig, dtype: np.dtype, activations: str = "float32") -> None:
        super().__init__(config, dtype)
        from kvlab.kernels import qdecode_layer, qgemv  # numba loads only for this backend
        from kvlab.kernels.decode_block import qdecode_block

        self._qfused, self._kernel_args, self._decode_block = qdecode_layer, qgemv.kernel_args, qdecode_block
        self._dot_kernel_args = qgemv.dot_kernel_args
        self.activations = activations
        if activations == "q8":  # the integer products beat bands + BLAS at any row count: one path for all
            self.max_fused_rows = 1 << 62

    def bind(self, layers: Sequence[Any]) -> list[Any]:
        from kvlab.model.quantized import QuantizedMatrix, RowStack

        # int8 activations: a row's integer sums and float32 steps (norms, activations: compiled row by row)
        # are the same whatever rows run beside it, so with batch-invariant attention a prefill gives each row
        # a decode step's bits (the rounding's input computed in one order on every path: `kvlab verify` holds
        # this lossy mode to equality); not where a layer keeps a float matrix (BLAS for a prefill, a gemv
        # kernel for a decode)
        if self.activations == "q8":
            self.batch_invariant = all(isinstance(getattr(layer, name), QuantizedLinear) for layer in layers
                                       for name in ("w_qkv", "w_o", "w_gate_up", "w_down"))

        def args(w: Any) -> tuple | None:
            if isinstance(w, RowStack):  # types differ: a tuple of the parts' tuples (qdecode_layer._stack_product)
                parts = [args(p) for p in w.parts]
                return None if None in parts or len(parts) > 3 else tuple(parts)
            if not isinstance(w, QuantizedMatrix):
                return None
            if self.activations == "q8":
                return self._dot_kernel_args(w.dot_layout, w.tail)
            return self._kernel_args(w.tiles, w.tail)

        def bound(layer: Any) -> Any:
            mlp = [args(w) for w in (layer.w_o, layer.w_gate_up, layer.w_down)]
            if not (layer.plain_mlp and self.fusable_mlp) or None in mlp:
                mlp = [None, None, None]
            qkv, vector = args(layer.w_qkv), self._vector
            if qkv is None and mlp[0] is None:
                return layer
            return QuantizedLayer(layer, qkv, vector(layer.b_qkv), vector(layer.q_norm), vector(layer.k_norm),
                                  mlp[0], vector(layer.b_o), mlp[1], mlp[2])

        return [bound(layer) for layer in layers]

    def _linear(self, x: np.ndarray, w: Any, bias: np.ndarray | None = None) -> np.ndarray:
        out = w.matmul_t(x, True, self.activations) if isinstance(w, QuantizedLinear) else self._gemv.linear(x, w)
        if bias is not None:
            out += bias
        return out

    def norm_linear(self, x: np.ndarray, norm: np.ndarray, w: Any,
                    bias: np.ndarray | None = None) -> np.ndarray:
        return self._linear(self._gemv.rms_norm(x, norm, self.eps), w, bias)

    def block_fuses(self, layer: Any, rows: int) -> bool:
        """Both halves fuse over quantized matrices (`bind`), in float32."""
        return (isinstance(layer, QuantizedLayer) and layer.qkv is not None and layer.o is not None
                and self._fuses(rows))

    def qkv_rope(self, x: np.ndarray, layer: Any, rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if isinstance(layer, QuantizedLayer) and layer.qkv is not None and x.shape[0] <= self.max_fused_rows:
            return self._fused_qkv_rope(self._qfused, x, layer, layer.qkv, rope)
        return self.stepwise_qkv_rope(x, getattr(layer, "layer", layer), rope)

    def output_mlp(self, x: np.ndarray, o: np.ndarray, layer: Any) -> None:
        if isinstance(layer, QuantizedLayer) and layer.o is not None and x.shape[0] <= self.max_fused_rows:
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
