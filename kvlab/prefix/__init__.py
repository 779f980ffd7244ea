"""Multi-turn reuse of the KV cache: sessions that keep their cache across turns, and session files."""

from kvlab.prefix.match import common_prefix_length
from kvlab.prefix.session import Session, Turn

__all__ = ["Session", "Turn", "common_prefix_length"]
