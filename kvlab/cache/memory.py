"""K/V memory: the analytic formula and the live report of an actual cache.

payload bytes = 2 (K and V) * L (layers) * B (batch) * H_kv * T (cached positions) * d (head_dim) * b,
where b is bytes per scalar. Capacity bytes are what is allocated (>= payload); metadata bytes are the
position ids and any tables kept beside the payload. Weights, activations and allocator overhead are
not K/V memory and are not counted.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from kvlab.config import ModelConfig

# Bytes per stored scalar. fp8/int8/int4 count the payload only: their per-group scales are extra.
DTYPE_BYTES: dict[str, float] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
}
DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "half": "float16",
                 "bf16": "bfloat16", "float8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'80GiB', '8 GB', '1e9', '524288' -> bytes. Raises ValueError naming the text."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte count (try 8GiB, 512MB or 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def canonical_dtype(name: str) -> str:
    key = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown cache dtype {name!r}; choose from {', '.join(DTYPE_BYTES)}")
    return key


def kv_bytes_per_token(config: ModelConfig, dtype: str = "float64") -> float:
    """K/V payload bytes one cached position adds, over all layers: 2 * L * H_kv * d * b."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * \
        DTYPE_BYTES[canonical_dtype(dtype)]


def kv_payload_bytes(config: ModelConfig, num_tokens: int, batch_size: int = 1,
                     dtype: str = "float64") -> float:
    """2 * L * B * H_kv * T * d * b."""
    return kv_bytes_per_token(config, dtype) * num_tokens * batch_size


def tokens_in_budget(config: ModelConfig, budget_bytes: int, batch_size: int = 1,
                     dtype: str = "float64") -> int:
    """How many positions per sequence fit in `budget_bytes` of K/V payload at this batch size."""
    return int(budget_bytes // (kv_bytes_per_token(config, dtype) * batch_size))


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
    metadata_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.capacity_bytes + self.metadata_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}
