"""`--kv-tier URL` to a backend: redis:// and valkey:// (Redis or Valkey), file:/// (a local folder)."""

from __future__ import annotations

from kvlab.errors import ConfigError
from kvlab.tier.backend import TierBackend


def open_backend(url: str) -> TierBackend:
    """The backend for `url`; ConfigError naming the problem for anything else. Connects lazily."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"--kv-tier {url!r}: expected redis://HOST:PORT/DB, valkey://... or file:///DIR")
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis", "rediss", "valkey", "valkeys"):
        try:
            from kvlab.tier.redis_tier import RedisTier
        except ImportError:
            raise ConfigError("a redis:// or valkey:// tier needs redis-py: pip install 'kvlab[tier]'") from None
        return RedisTier(url)
    if scheme == "file":
        from kvlab.tier.file_tier import FileTier
        return FileTier(url)
    raise ConfigError(f"--kv-tier {url!r}: unknown scheme {scheme!r} (redis, valkey, file)")
