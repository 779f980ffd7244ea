"""K/V memory: the analytic formula and the live report of an actual cache.

payload bytes = 2 (K and V) * L (layers) * B (batch) * H_kv * T (cached positions) * d (head_dim) * b,
where b is bytes per scalar. Capacity bytes are what is allocated (>= payload); metadata bytes are the
position ids and any tables kept beside the payload. Weights, activations and allocator overhead are
not K/V memory and are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction

from kvlab.cache.dtypes import PAYLOAD_BYTES, scale_bytes_per_row, size_name
from kvlab.config import ModelConfig

# Bytes per stored scalar, by storage kind (kvlab/cache/dtypes.py). fp8/int8/int4 count the payload only:
# their per-group scales are extra (kv_scale_bytes_per_token).
DTYPE_BYTES: dict[str, float] = {name: float(b) if b.denominator > 1 else int(b) for name, b in PAYLOAD_BYTES.items()}


def canonical_dtype(name: object) -> str:
    """The storage kind a cache-dtype name is sized as ("BF16" -> "bfloat16", "int8-channel" -> "int8")."""
    return size_name(name)


def kv_bytes_per_token(config: ModelConfig, dtype: object = "float64") -> float:
    """K/V payload bytes one cached position adds, over all layers: 2 * L * H_kv * d * b."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * \
        DTYPE_BYTES[size_name(dtype)]


def kv_scale_bytes_per_token(config: ModelConfig, dtype: object = "float64") -> float:
    """Metadata bytes one cached position adds for a quantized dtype: int8/int4 keep a float16 scale and
    zero per group of 32 values along head_dim (one group per head when head_dim is not a multiple of 32),
    as kvlab/cache/quantized.py stores them; float dtypes and fp8 (a plain cast) keep none."""
    if size_name(dtype) not in ("int8", "int4"):
        return 0.0
    return 2 * config.num_hidden_layers * config.num_key_value_heads * scale_bytes_per_row(dtype, config.head_dim)


def _exact_bytes_per_token(config: ModelConfig, dtype: object) -> Fraction:
    """Payload plus scales of one position, as an exact rational (int4 is half a byte per scalar)."""
    payload = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * \
        PAYLOAD_BYTES[size_name(dtype)]
    return payload + Fraction(kv_scale_bytes_per_token(config, dtype))


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: object) -> int:
    """Bytes one block of `block_size` positions takes in a block pool, payload and scales: an int, so a
    budget divided by it is a whole number of blocks (kvlab/cache/paged.py allocates exactly this)."""
    return int(_exact_bytes_per_token(config, dtype) * block_size)


def blocks_in_budget(config: ModelConfig, budget_bytes: int, block_size: int, dtype: object) -> int:
    """How many whole blocks fit in `budget_bytes`."""
    return int(budget_bytes) // kv_bytes_per_block(config, block_size, dtype)


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
