"""Cache policies: what to keep when the cache is full (window, sinks, context shift, heavy hitters)."""

from kvlab.policies.apply import check_policy, forward_with_policy, make_room
from kvlab.policies.base import Policy
from kvlab.policies.h2o import HeavyHitters
from kvlab.policies.parse import CacheChoice, parse_cache_choice, parse_policy
from kvlab.policies.shift import ContextShift, rerotate_keys
from kvlab.policies.sinks import AttentionSinks
from kvlab.policies.window import SlidingWindow

__all__ = ["AttentionSinks", "CacheChoice", "ContextShift", "HeavyHitters", "Policy", "SlidingWindow",
           "check_policy", "forward_with_policy", "make_room", "parse_cache_choice", "parse_policy",
           "rerotate_keys"]
