"""Cache policies: what to keep when the cache is full (window, sinks, context shift). The engine runs
them (kvlab/engine/kv_bounds.py); a policy only chooses rows."""

from kvlab.policies.base import Policy
from kvlab.policies.parse import CacheChoice, parse_cache_choice, parse_policy
from kvlab.policies.shift import ContextShift, rotate_keys
from kvlab.policies.sinks import AttentionSinks
from kvlab.policies.window import SlidingWindow

__all__ = ["AttentionSinks", "CacheChoice", "ContextShift", "Policy", "SlidingWindow", "parse_cache_choice",
           "parse_policy", "rotate_keys"]
