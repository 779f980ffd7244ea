"""KV events in vLLM's wire format, read by a plain pyzmq subscriber: frames, maps, order, salts."""

from __future__ import annotations

import struct
import time

import msgpack
import numpy as np
import pytest
import zmq

import kvlab
from kvlab.engine.engine import Engine
from kvlab.sampling.sampler import SamplingParams
from kvlab.errors import ConfigError
from kvlab.events.config import KVEventsConfig
from kvlab.events.messages import block_hash
from serve_helpers import free_port

MODEL = kvlab.TinyLlama(seed=7, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [int(t) for t in np.random.default_rng(9).integers(0, MODEL.config.vocab_size, 70)]
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name"}
WAIT_S = 60


class Subscriber:
    """A SUB socket on the engine's endpoint; `sync()` makes sure the subscription is live first."""

    def __init__(self, engine: Engine, endpoint: str, topic: bytes = b"") -> None:
        self.engine = engine
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.last_seq: int | None = None
        self.topics: set[bytes] = set()

    def batches(self, timeout_ms: int = 200):
        while self.socket.poll(timeout_ms):
            topic, seq, payload = self.socket.recv_multipart()
            seq = struct.unpack(">Q", seq)[0]
            if self.last_seq is not None:
                assert seq == self.last_seq + 1, "sequence numbers must have no gaps"
            self.last_seq = seq
            self.topics.add(topic)
            ts, events, rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and rank == 0
            yield topic, seq, events

    def sync(self) -> None:
        """PUB drops what it sends before a subscription arrives: send AllBlocksCleared until one is seen."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.engine.reset_prefix_cache()
            if any(e == {"type": "AllBlocksCleared"} for _, _, events in self.batches() for e in events):
                return
        raise AssertionError("no event reached the subscriber")

    def events_until(self, predicate) -> list[dict]:
        seen: list[dict] = []
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for _, _, events in self.batches():
                seen += events
            if predicate(seen):
                return seen
        raise AssertionError(f"events never satisfied the test: {seen}")

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def events_engine(topic: str = "", **kw) -> tuple[Engine, str]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}
    return Engine(MODEL, kv_events_config=config, **kw), endpoint


def test_block_stored_events_carry_exactly_vllms_fields_and_chain():
    engine, endpoint = events_engine(topic="kv@kvlab")
    sub = Subscriber(engine, endpoint)
    try:
        sub.sync()
        engine.generate([PROMPT], GREEDY)
        stored = [e for e in sub.events_until(lambda s: sum(e["type"] == "BlockStored" for e in s) == 4)
                  if e["type"] == "BlockStored"]
        assert all(set(e) == STORED_KEYS for e in stored)
        assert [e["token_ids"] for e in stored] == [PROMPT[i:i + 16] for i in range(0, 64, 16)]
        assert stored[0]["parent_block_hash"] is None
        for parent, child in zip(stored, stored[1:]):
            assert child["parent_block_hash"] == parent["block_hashes"][0]
        assert all(e["block_size"] == 16 and e["lora_id"] is None and e["lora_name"] is None for e in stored)
        assert len({e["block_hashes"][0] for e in stored}) == 4
        assert all(0 <= e["block_hashes"][0] < 2 ** 63 for e in stored)
    finally:
        sub.close()
        engine.close()


def test_every_batch_has_the_topic_and_the_sequence_has_no_gaps():
    engine, endpoint = events_engine(topic="kv@kvlab")
    sub = Subscriber(engine, endpoint)
    try:
        sub.sync()
        engine.generate([PROMPT], GREEDY)
        assert engine.reset_prefix_cache()
        sub.events_until(lambda s: any(e["type"] == "BlockStored" for e in s)
                         and s[-1] == {"type": "AllBlocksCleared"})
        engine.close()  # every queued event is sent: the publisher's count is final
        assert sub.topics == {b"kv@kvlab"}
        assert sub.last_seq == engine.cache_listener.events.seq - 1  # the last batch sent is the last seen
        stats = engine.stats()
        assert stats["kv_events_sent"] == stats["kv_events_queued"]
    finally:
        sub.close()
        engine.close()


def test_eviction_publishes_removed_and_reset_all_cleared_but_salted_blocks_stay_silent():
    engine, endpoint = events_engine(num_blocks=6)
    sub = Subscriber(engine, endpoint)
    try:
        sub.sync()
        engine.generate([PROMPT], GREEDY, cache_salt="tenant-a")  # 4 full salted blocks: never announced
        other = [int(t) for t in np.random.default_rng(10).integers(0, MODEL.config.vocab_size, 70)]
        engine.generate([other], GREEDY)  # needs 5 blocks: evicts salted blocks (silently)
        engine.generate([PROMPT], GREEDY)  # evicts `other`'s blocks: BlockRemoved for announced ones
        seen = sub.events_until(lambda s: any(e["type"] == "BlockRemoved" for e in s)
                                and sum(e["type"] == "BlockStored" for e in s) >= 8)
        stored = [e for e in seen if e["type"] == "BlockStored"]
        announced = {e["block_hashes"][0] for e in stored}
        assert [e["token_ids"] for e in stored[:4]] == [other[i:i + 16] for i in range(0, 64, 16)]
        assert all(e["token_ids"] != PROMPT[:16] or e["parent_block_hash"] is None for e in stored)
        assert sum(e["token_ids"] == PROMPT[:16] for e in stored) == 1  # the unsalted run only
        removed = [h for e in seen if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed and set(removed) <= announced
        assert all(set(e) == {"type", "block_hashes", "medium"} for e in seen if e["type"] == "BlockRemoved")
        assert engine.reset_prefix_cache()
        assert sub.events_until(lambda s: s and s[-1] == {"type": "AllBlocksCleared"})
    finally:
        sub.close()
        engine.close()


def test_block_hash_is_a_63_bit_int_of_the_chain_key():
    assert block_hash(b"\xff" * 32) == 2 ** 63 - 1 and block_hash(b"\x00" * 32) == 0


@pytest.mark.parametrize("config, match", [
    ("{not json", "not JSON"), ("[1]", "JSON object"), ('{"enable_kv_cache_events": "yes"}', "true or false"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "ZMQ address"),
    ('{"enable_kv_cache_events": true, "topics": "x"}', "unknown field"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:1"}', "replay_endpoint"),
])
def test_bad_events_configs_are_refused_by_name(config, match):
    with pytest.raises(ConfigError, match=match):
        KVEventsConfig.parse(config)


def test_vllms_defaults_and_a_taken_endpoint():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert config.enabled and config.endpoint == "tcp://127.0.0.1:5557" and config.topic == ""
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').enabled
    engine, endpoint = events_engine()
    try:
        with pytest.raises(ConfigError, match="cannot bind"):
            Engine(MODEL, kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})
    finally:
        engine.close()
