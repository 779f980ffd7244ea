"""K/V memory: the analytic formula and the live report of an actual cache.

payload bytes = 2 (K and V) * L (layers) * B (batch) * H_kv * T (cached positions) * d (head_dim) * b,
where b is bytes per scalar, for a model whose every layer holds every token. Models with sliding windows,
MLA latents or constant-state layers are sized per KV-cache group from their layer specs
(kvlab/cache/kv_spec.py): each group holds `tokens_held(T)` tokens of its bytes per token, plus its state.
Capacity bytes are what is allocated (>= payload); metadata bytes are the position ids and any tables kept
beside the payload. Weights, activations and allocator overhead are not K/V memory and are not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from fractions import Fraction

from kvlab.cache.dtypes import PAYLOAD_BYTES, size_name
from kvlab.cache.kv_spec import KVCacheGroup, LayerSpecs, kv_cache_groups, model_config_specs
from kvlab.config import ModelConfig

# Bytes per stored scalar, by storage kind (kvlab/cache/dtypes.py). fp8/int8/int4 count the payload only:
# their per-group scales are extra (kv_scale_bytes_per_token).
DTYPE_BYTES: dict[str, float] = {name: float(b) if b.denominator > 1 else int(b) for name, b in PAYLOAD_BYTES.items()}


def canonical_dtype(name: object) -> str:
    """The storage kind a cache-dtype name is sized as ("BF16" -> "bfloat16", "int8-channel" -> "int8")."""
    return size_name(name)


def _number(value: Fraction) -> int | float:
    """An exact byte count as JSON prints it: an int when whole (int4 can make half bytes)."""
    return int(value) if value.denominator == 1 else float(value)


def specs_payload_bytes_per_token(layer_specs: LayerSpecs, dtype: object) -> Fraction:
    """K/V payload one more token adds over all layers that hold it (MLA: one latent; states: none)."""
    return sum((spec.payload_bytes_per_token(dtype) for specs in layer_specs for spec in specs), Fraction(0))


def specs_scale_bytes_per_token(layer_specs: LayerSpecs, dtype: object) -> int:
    """int8/int4 scales one more token adds over all layers that hold it."""
    return sum(spec.scale_bytes_per_token(dtype) for specs in layer_specs for spec in specs)


def kv_bytes_per_token(config: ModelConfig, dtype: object = "float64") -> int | float:
    """K/V payload bytes one cached position adds, over all layers: 2 * L * H_kv * d * b."""
    return _number(specs_payload_bytes_per_token(model_config_specs(config), dtype))


def kv_scale_bytes_per_token(config: ModelConfig, dtype: object = "float64") -> int:
    """Metadata bytes one cached position adds for a quantized dtype: int8/int4 keep a float16 scale and
    zero per group of 32 values along head_dim (one group per head when head_dim is not a multiple of 32),
    as kvlab/cache/quantized.py stores them; float dtypes and fp8 (a plain cast) keep none."""
    return specs_scale_bytes_per_token(model_config_specs(config), dtype)


def _exact_bytes_per_token(config: ModelConfig, dtype: object) -> Fraction:
    """Payload plus scales of one position, as an exact rational (int4 is half a byte per scalar)."""
    layer_specs = model_config_specs(config)
    return specs_payload_bytes_per_token(layer_specs, dtype) + specs_scale_bytes_per_token(layer_specs, dtype)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: object) -> int:
    """Bytes one block of `block_size` positions takes in a block pool, payload and scales: an int, so a
    budget divided by it is a whole number of blocks (kvlab/cache/paged.py allocates exactly this)."""
    return int(_exact_bytes_per_token(config, dtype) * block_size)


def kv_payload_bytes(config: ModelConfig, num_tokens: int, batch_size: int = 1,
                     dtype: str = "float64") -> float:
    """2 * L * B * H_kv * T * d * b."""
    return kv_bytes_per_token(config, dtype) * num_tokens * batch_size


def tokens_in_budget(config: ModelConfig, budget_bytes: int, batch_size: int = 1,
                     dtype: str = "float64") -> int:
    """How many positions per sequence fit in `budget_bytes` of K/V (payload and scales) at this batch size."""
    # exact rationals (int4 is half a byte): a float quotient would round a budget just short of n tokens up to n
    per_token = _exact_bytes_per_token(config, dtype)
    return int(Fraction(budget_bytes) // (per_token * batch_size))


@dataclass(frozen=True)
class GroupBytes:
    """What one KV-cache group costs for `num_tokens` per sequence x `batch` sequences."""

    group: KVCacheGroup
    payload_bytes_per_token: Fraction  # one more held token, over all the group's layers
    scale_bytes_per_token: int
    tokens_held: int                   # per sequence, per layer
    kv_bytes: Fraction                 # tokens_held x (payload + scales) per token x batch
    state_bytes: int                   # the constant per-sequence state of all its layers x batch

    @property
    def total_bytes(self) -> Fraction:
        return self.kv_bytes + self.state_bytes


def group_bytes(layer_specs: LayerSpecs, num_tokens: int, batch_size: int, dtype: object,
                state_dtype: object) -> list[GroupBytes]:
    """Bytes of each KV-cache group for `num_tokens` per sequence: the K/V a group holds grows with the tokens
    it keeps (all of them, or its window), its state does not."""
    rows = []
    for group in kv_cache_groups(layer_specs):
        spec, count = group.spec, len(group.layers)
        held = spec.tokens_held(num_tokens)
        payload, scales = count * spec.payload_bytes_per_token(dtype), count * spec.scale_bytes_per_token(dtype)
        rows.append(GroupBytes(group, payload, scales, held, (payload + scales) * held * batch_size,
                               count * spec.state_bytes(state_dtype) * batch_size))
    return rows


def cache_bytes(layer_specs: LayerSpecs, num_tokens: int, batch_size: int, dtype: object,
                state_dtype: object) -> Fraction:
    """What `num_tokens` per sequence x `batch_size` sequences really cost: K/V held, scales and states."""
    return sum((row.total_bytes for row in group_bytes(layer_specs, num_tokens, batch_size, dtype, state_dtype)),
               Fraction(0))


def specs_tokens_in_budget(layer_specs: LayerSpecs, budget_bytes: int, batch_size: int, dtype: object,
                           state_dtype: object) -> int | None:
    """The most tokens per sequence whose cache (cache_bytes) fits `budget_bytes` at this batch size; None
    when no length outgrows it (every layer holds a window or a state, and those fit)."""
    def fits(tokens: int) -> bool:
        return cache_bytes(layer_specs, tokens, batch_size, dtype, state_dtype) <= budget_bytes

    if not fits(0):
        return 0  # the states alone do not fit
    growing = [spec.bytes_per_token(dtype) for specs in layer_specs for spec in specs
               if spec.tokens_held(2**62) == 2**62 and spec.bytes_per_token(dtype) > 0]
    if not growing:
        windows = [spec.tokens_held(2**62) for specs in layer_specs for spec in specs]
        return None if fits(max(windows, default=0)) else _last_fitting(fits, max(windows))
    return _last_fitting(fits, int(Fraction(budget_bytes) // (sum(growing) * batch_size)))


def _last_fitting(fits: Callable[[int], bool], high: int) -> int:
    """The largest t in [0, high] with fits(t), for a monotone `fits` that holds at 0 and fails past high."""
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


@dataclass(frozen=True)
class MemoryReport:
    """What a live cache holds: payload (K/V values), capacity (allocated) and metadata bytes."""

    num_layers: int
    batch_size: int
    num_tokens: int
    capacity_tokens: int
    dtype: str
    payload_bytes: int
    capacity_bytes: int
    metadata_bytes: int   # position ids, plus the scales of a quantized cache
    scale_bytes: int = 0  # the quantized cache's scales and zero points (already in metadata_bytes)

    @property
    def total_bytes(self) -> int:
        return self.capacity_bytes + self.metadata_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}
