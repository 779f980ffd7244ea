"""Prometheus metrics with vLLM's names under a `kvlab:` prefix, so vLLM dashboards work with a rename.

Engine counters and gauges are read from the loop's latest `engine.stats()` snapshot at scrape time (a
custom collector), so they can never drift from the engine's own accounting. Latency histograms are
observed by the loop thread as outputs come out of `step()`. Each server has its own registry.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvlab.tier.listener import LISTENER_COUNTERS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name without prefix, engine.stats() key, help); counters get Prometheus' `_total` suffix
ENGINE_GAUGES = [
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage, 0..1 (cached-evictable blocks count as free)"),
    ("num_requests_running", "num_running", "Requests in the running batch"),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be admitted"),
]
ENGINE_COUNTERS = [
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    ("num_preemptions", "num_preemptions", "Requests preempted (recomputed later) for lack of blocks"),
    ("prompt_tokens", "num_prompt_tokens", "Prompt tokens processed"),
    ("generation_tokens", "num_generation_tokens", "Tokens generated"),
    *LISTENER_COUNTERS,  # issue 23: KV tier (lookups, hits, bytes, dropped, refused, errors), KV events
    # speculative decoding (issue 35), vLLM's spec_decode_* names
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Verifications of speculative guesses"),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative tokens guessed"),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Speculative tokens accepted"),
]
SPEC_PER_POS = ("spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_accepted_tokens_per_pos",
                "Speculative tokens accepted, by their position among the guesses (0: the first)")
# per KV-cache group (layer type: kvlab/engine/kv_groups.py), labelled group, layer_type and window
GROUP_GAUGES = [
    ("kv_cache_group_used_bytes", "used_bytes", "K/V bytes in blocks requests hold, per KV-cache group"),
    ("kv_cache_group_capacity_bytes", "capacity_bytes", "K/V bytes allocated, per KV-cache group"),
    ("kv_cache_group_used_blocks", "num_used_blocks", "Blocks requests hold, per KV-cache group"),
]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)


class _EngineCollector:
    """Yields the engine's counters and gauges from the latest stats snapshot."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snapshot = self.stats()
        for name, key, doc in ENGINE_GAUGES:
            family = GaugeMetricFamily(f"kvlab:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], float(snapshot.get(key, 0)))
            yield family
        for name, key, doc in ENGINE_COUNTERS:
            family = CounterMetricFamily(f"kvlab:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], float(snapshot.get(key, 0)))
            yield family
        name, key, doc = SPEC_PER_POS  # one sample per guess position seen so far, as vLLM labels them
        family = CounterMetricFamily(f"kvlab:{name}", doc, labels=["model_name", "position"])
        for position, count in enumerate(snapshot.get(key, ())):
            family.add_metric([self.model_name, str(position)], float(count))
        yield family
        for name, key, doc in GROUP_GAUGES:  # a hybrid model's layer types each have their own pool
            family = GaugeMetricFamily(f"kvlab:{name}", doc, labels=["model_name", "group", "layer_type", "window"])
            for group in snapshot.get("kv_cache_groups", ()):
                family.add_metric([self.model_name, str(group["group"]), group["layer_type"],
                                   "" if group["window"] is None else str(group["window"])], float(group[key]))
            yield family


class ServerMetrics:
    """The server's registry. `bind(stats)` hooks up the engine snapshot; `render()` is /metrics' body."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._ttft = Histogram("kvlab:time_to_first_token_seconds", "Time from arrival to the first token",
                               ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram("kvlab:inter_token_latency_seconds", "Time between a request's token outputs",
                              ["model_name"], buckets=ITL_BUCKETS, registry=self.registry)
        self._success = Counter("kvlab:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = self._ttft.labels(**labels)
        self.itl = self._itl.labels(**labels)

    def bind(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_EngineCollector(stats, self.model_name))

    def request_finished(self, reason: str) -> None:
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
