"""`--kv-events-config JSON`: vLLM's KVEventsConfig fields, checked, with a loopback default endpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvlab.errors import ConfigError

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # vLLM binds tcp://*:5557; kvlab stays on loopback unless told
# vLLM's fields kvlab accepts but has no use for (a replay socket is not implemented: see the README)
_IGNORED = {"buffer_steps", "hwm", "max_queue_size"}


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"     # "zmq" or "null"
    endpoint: str = DEFAULT_ENDPOINT
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | KVEventsConfig | None") -> "KVEventsConfig":
        """From the flag's JSON text (or a dict); ConfigError naming the bad field."""
        if value is None or isinstance(value, KVEventsConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError("--kv-events-config must be a JSON object")
        known = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "replay_endpoint"} | _IGNORED
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
        if value.get("replay_endpoint") is not None:
            raise ConfigError("--kv-events-config: replay_endpoint is not supported by kvlab")
        enable = value.get("enable_kv_cache_events", False)
        if not isinstance(enable, bool):
            raise ConfigError(f"--kv-events-config: enable_kv_cache_events must be true or false, got {enable!r}")
        publisher = value.get("publisher", "zmq" if enable else "null")
        if publisher not in ("zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", got {publisher!r}")
        endpoint = value.get("endpoint", DEFAULT_ENDPOINT)
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"--kv-events-config: endpoint must be a ZMQ address such as {DEFAULT_ENDPOINT}, "
                              f"got {endpoint!r}")
        topic = value.get("topic", "")
        if not isinstance(topic, str):
            raise ConfigError(f"--kv-events-config: topic must be a string, got {topic!r}")
        return cls(enable, publisher, endpoint, topic)
