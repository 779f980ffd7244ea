"""Multi-turn reuse of the KV cache, above the engine: sessions that keep their cache across turns,
conversations, session files and prompt caches."""

from kvlab.prefix.token_prefix import common_prefix_length
from kvlab.sessions.session import Session, Turn

__all__ = ["Session", "Turn", "common_prefix_length"]
