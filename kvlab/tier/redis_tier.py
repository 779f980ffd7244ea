"""`redis://host:port/db` and `valkey://...`: a shared tier on Redis or Valkey through redis-py.

Lookups are two round trips whatever the prompt's length: one pipeline of EXISTS for the candidate keys
(the longest present run is kept), then one MGET for that run. An entry evicted between the two (the
server is expected to run `maxmemory-policy allkeys-lru`) comes back None and ends the run: a miss, not an
error. Writes are `SET NX` with an optional TTL, so the first writer of a block wins and later writers
cost one round trip. Every call is bounded by the socket timeout and never retried here: a slow tier
makes the request compute, it does not make it wait.

Query parameters: `ttl` (seconds, default none), `timeout` (seconds per call, default 1.0), `retry`
(seconds a failed tier is left alone before it is tried again, default 5; 0 = try every time).
"""

from __future__ import annotations

import math
from typing import Sequence
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvlab.errors import ConfigError
from kvlab.tier.backend import TierUnavailable

DEFAULT_TIMEOUT_S = 1.0
DEFAULT_RETRY_S = 5.0  # after a failure, the tier is left alone this long (kvlab/tier/health.py)


def _number(params: dict, name: str, default: float | None, allow_zero: bool = False) -> float | None:
    """A query parameter as a finite number > 0 (or >= 0 with allow_zero)."""
    if name not in params:
        return default
    text = params[name][-1]
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--kv-tier: {name}={text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"--kv-tier: {name} must be a finite number {'>=' if allow_zero else '>'} 0, "
                          f"got {text!r}")
    return value


class RedisTier:
    """A Redis/Valkey server as a tier (see the module docstring for the URL form)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "valkey", "rediss", "valkeys"):
            raise ConfigError(f"--kv-tier {url!r}: not a redis:// or valkey:// URL")
        params = parse_qs(parts.query)
        unknown = set(params) - {"ttl", "timeout", "retry"}
        if unknown:
            raise ConfigError(f"--kv-tier {url!r}: unknown parameter(s) {sorted(unknown)} (ttl, timeout, retry)")
        ttl = _number(params, "ttl", None)
        self.ttl = None if ttl is None else max(1, int(ttl))
        self.timeout = _number(params, "timeout", DEFAULT_TIMEOUT_S)
        self.retry_s = _number(params, "retry", DEFAULT_RETRY_S, allow_zero=True)
        try:
            db = int(parts.path.strip("/") or 0)
            port = parts.port or 6379
        except ValueError:
            raise ConfigError(f"--kv-tier {url!r}: the port and database must be numbers") from None
        self.name = f"{parts.scheme}://{parts.hostname or '127.0.0.1'}:{port}/{db}"
        self.client = redis.Redis(
            host=parts.hostname or "127.0.0.1", port=port, db=db, username=parts.username or None,
            password=parts.password or None, ssl=parts.scheme in ("rediss", "valkeys"), socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout, retry=Retry(NoBackoff(), 0),
            health_check_interval=0)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except (redis.RedisError, OSError) as exc:
            raise TierUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from None

    def ping(self) -> None:
        """Connect now (the writer thread calls this at start), so the first lookup does not pay for it."""
        self._call(self.client.ping)

    def run_length(self, names: Sequence[str]) -> int:
        if not names:
            return 0
        def exists() -> list:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()
        found = self._call(exists)
        run = 0
        while run < len(found) and found[run]:
            run += 1
        return run

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        return list(self._call(self.client.mget, list(names))) if names else []

    def put(self, name: str, value: bytes) -> bool:
        return bool(self._call(lambda: self.client.set(name, value, nx=True, ex=self.ttl)))

    def close(self) -> None:
        self.client.close()
