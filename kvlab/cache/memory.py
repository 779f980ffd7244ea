"""K/V memory: the analytic formula and the live report of an actual cache.

payload bytes = 2 (K and V) * L (layers) * B (batch) * H_kv * T (cached positions) * d (head_dim) * b,
where b is bytes per scalar. Capacity bytes are what is allocated (>= payload); metadata bytes are the
position ids and any tables kept beside the payload. Weights, activations and allocator overhead are
not K/V memory and are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction

from kvlab.config import ModelConfig
from kvlab.errors import InputError

# Bytes per stored scalar. fp8/int8/int4 count the payload only: their per-group scales are extra.
DTYPE_BYTES: dict[str, float] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
}
DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "half": "float16",
                 "bf16": "bfloat16", "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8",
                 "int8-token": "int8", "int8-channel": "int8", "int4-token": "int4", "int4-channel": "int4"}

def canonical_dtype(name: str) -> str:
    key = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DTYPE_BYTES:
        raise InputError(f"unknown cache dtype {name!r}; choose from {', '.join(DTYPE_BYTES)}")
    return key


def kv_bytes_per_token(config: ModelConfig, dtype: str = "float64") -> float:
    """K/V payload bytes one cached position adds, over all layers: 2 * L * H_kv * d * b."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * \
        DTYPE_BYTES[canonical_dtype(dtype)]


def kv_scale_bytes_per_token(config: ModelConfig, dtype: str = "float64") -> float:
    """Metadata bytes one cached position adds for a quantized dtype: int8/int4 keep a float16 scale and
    zero per group of 32 values along head_dim (one group per head when head_dim is not a multiple of 32),
    as kvlab/cache/quantized.py stores them; float dtypes and fp8 (a plain cast) keep none."""
    if canonical_dtype(dtype) not in ("int8", "int4"):
        return 0.0
    group = 32 if config.head_dim % 32 == 0 else config.head_dim
    return 2 * config.num_hidden_layers * config.num_key_value_heads * (config.head_dim // group) * 2 * 2


def kv_payload_bytes(config: ModelConfig, num_tokens: int, batch_size: int = 1,
                     dtype: str = "float64") -> float:
    """2 * L * B * H_kv * T * d * b."""
    return kv_bytes_per_token(config, dtype) * num_tokens * batch_size


def tokens_in_budget(config: ModelConfig, budget_bytes: int, batch_size: int = 1,
                     dtype: str = "float64") -> int:
    """How many positions per sequence fit in `budget_bytes` of K/V (payload and scales) at this batch size."""
    # exact rationals (int4 is half a byte): a float quotient would round a budget just short of n tokens up to n
    per_token = Fraction(kv_bytes_per_token(config, dtype)) + Fraction(kv_scale_bytes_per_token(config, dtype))
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
