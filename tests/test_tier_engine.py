"""The KV tier inside the engine, on a disk tier: warm restarts, salts, exact outputs, the write queue."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvlab
from kvlab.engine.engine import Engine
from kvlab.sampling.sampler import SamplingParams
from kvlab.errors import ConfigError
from kvlab.prefix.block_hash import block_key, root_key
from kvlab.tier.keys import key_name, tier_key
from kvlab.tier.file_tier import FileTier
from kvlab.tier.tier import KVTier

MODEL = kvlab.TinyLlama(seed=7, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0, max_tokens=20)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, MODEL.config.vocab_size, 90)]


def cold(prompt, params=GREEDY):
    return Engine(MODEL).generate([prompt], params)[0].outputs[0].token_ids


def run(engine, prompt, params=GREEDY, salt=None):
    out = engine.generate([prompt], params, cache_salt=salt)[0]
    engine.block_pool.check_invariants()
    return out


def test_a_restarted_engine_starts_warm_from_the_disk_tier(tmp_path):
    url = f"file://{tmp_path}/tier"
    first = Engine(MODEL, kv_tiers=[url])
    a = run(first, PROMPT)
    first.close(30)
    assert first.stats()["kv_tier_written_blocks"] == (90 + 19) // 16  # prompt and generated blocks
    follow = PROMPT + a.outputs[0].token_ids  # the next turn starts with everything computed before
    second = Engine(MODEL, kv_tiers=[url])
    b = run(second, follow)
    assert b.num_cached_tokens == (len(follow) - 1) // 16 * 16 == 96
    assert b.outputs[0].token_ids == cold(follow)
    stats = second.stats()
    assert stats["kv_tier_hit_blocks"] == 6 and stats["kv_tier_hit_tokens"] == 96
    assert stats["kv_tier_read_bytes"] > 6 * second.block_pool.bytes_per_block
    assert stats["num_prefill_tokens"] == len(follow) - 96
    second.add_request("shown", follow, GREEDY)
    second.step()  # the hit is admitted and the rest of the prompt computed: the explorer's view of it
    [shown] = second.cache_state()["requests"]
    # b left its rows cached locally, whole blocks and tail: all but the last token; 96 of them came from the tier
    assert (shown["num_cached_tokens"], shown["num_tier_tokens"]) == (len(follow) - 1, 96)
    while second.has_unfinished_requests():
        second.step()
    again = run(second, follow)  # now held locally, tail rows too (a tier keeps whole blocks): no tier read
    assert again.num_cached_tokens == len(follow) - 1 and second.stats()["kv_tier_hit_blocks"] == 6
    second.close(30)


def test_blocks_loaded_from_the_tier_show_their_chain_in_the_cache_state(tmp_path):
    """A restarted engine whose request computes no whole block past its tier hits (so nothing is inserted
    locally under the root) still traces the loaded blocks to the unsalted root: the first starts the chain
    (no parent), so the server shows their text to unsalted callers."""
    url = f"file://{tmp_path}/tier"
    first = Engine(MODEL, kv_tiers=[url])
    run(first, PROMPT[:40], SamplingParams(temperature=0, max_tokens=1))
    first.close(30)
    second = Engine(MODEL, kv_tiers=[url])
    out = run(second, PROMPT[:34], SamplingParams(temperature=0, max_tokens=1))
    assert out.num_cached_tokens == 32 and second.stats()["kv_tier_hit_blocks"] == 2
    unsalted = root_key(MODEL.fingerprint, MODEL.dtype, second.kv_cache_dtype).hex()
    blocks = second.cache_state()["blocks"]
    assert [b["num_tokens"] for b in blocks] == [16, 16]
    assert [b["root_key"] for b in blocks] == [unsalted, unsalted]
    assert blocks[0]["parent"] is None and blocks[1]["parent"] == blocks[0]["hash"]
    second.close(30)


def test_salted_blocks_are_reachable_only_with_their_salt(tmp_path):
    url = f"file://{tmp_path}/tier"
    writer = Engine(MODEL, kv_tiers=[url])
    run(writer, PROMPT, salt="tenant-a")
    writer.close(30)
    for salt, expect in ((None, 0), ("tenant-b", 0), ("tenant-a", 80)):
        reader = Engine(MODEL, kv_tiers=[url])
        out = run(reader, PROMPT, salt=salt)
        assert out.num_cached_tokens == expect, salt
        assert out.outputs[0].token_ids == cold(PROMPT)
        reader.close(30)


def test_corrupt_files_are_refused_and_recomputed_exactly(tmp_path):
    url = f"file://{tmp_path}/tier"
    writer = Engine(MODEL, kv_tiers=[url])
    run(writer, PROMPT)
    writer.close(30)
    files = sorted((tmp_path / "tier").rglob("kvlab_kv_v1_*"))
    assert len(files) == 6
    for path in files:  # damage every entry: one byte of payload, or a cut
        data = path.read_bytes()
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:] if path.name < files[3].name
                         else data[:len(data) - 100])
    reader = Engine(MODEL, kv_tiers=[url])
    out = run(reader, PROMPT)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == cold(PROMPT)
    assert reader.stats()["kv_tier_refused_entries"] >= 1 and reader.stats()["kv_tier_hit_blocks"] == 0
    reader.close(30)


def test_tier_hits_in_a_small_pool_keep_it_balanced_and_exact(tmp_path):
    url = f"file://{tmp_path}/tier"
    writer = Engine(MODEL, kv_tiers=[url])
    run(writer, PROMPT)
    writer.close(30)
    small = Engine(MODEL, kv_tiers=[url], num_blocks=8)  # 90 + 20 tokens need 7 of the 8 blocks
    outs = [run(small, PROMPT) for _ in range(2)]
    assert [o.outputs[0].token_ids for o in outs] == [cold(PROMPT)] * 2
    assert outs[0].num_cached_tokens == 80
    small.close(30)


class BlockingBackend(FileTier):
    """A file tier whose writes wait for the test, so the queue's states are reached deterministically."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.entered = threading.Event()
        self.release = threading.Event()

    def put(self, name: str, value: bytes) -> bool:
        self.entered.set()
        assert self.release.wait(60)
        return super().put(name, value)


def test_a_full_write_queue_drops_and_counts_and_close_is_bounded(tmp_path):
    engine = Engine(MODEL)
    backend = BlockingBackend(f"file://{tmp_path}/tier")
    tier = KVTier([backend], engine.block_pool, queue_blocks=2)
    root, key = b"r" * 32, b"k" * 32
    tier.store(0, key, root, range(16))
    assert backend.entered.wait(60)  # the writer holds block 1 inside put
    for i in range(1, 5):
        tier.store(i, bytes([i]) * 32, root, range(16))
    assert tier.stats.snapshot()["kv_tier_dropped_writes"] == 2  # two queued, two dropped
    assert not tier.flush(timeout=0.2)  # cannot drain while the backend is stuck
    backend.release.set()
    assert tier.flush(timeout=60)
    stats = tier.stats.snapshot()
    assert stats["kv_tier_written_blocks"] == 3 and stats["kv_tier_dropped_writes"] == 2
    assert tier.close(5)


def test_close_gives_up_on_a_stuck_tier_after_its_timeout(tmp_path):
    engine = Engine(MODEL)
    backend = BlockingBackend(f"file://{tmp_path}/tier")
    tier = KVTier([backend], engine.block_pool, queue_blocks=4)
    for i in range(3):
        tier.store(i, bytes([i + 1]) * 32, b"r" * 32, range(16))
    assert backend.entered.wait(60)
    assert not tier.close(timeout=0.2)  # the first write never returns in time: the rest is dropped
    assert tier.stats.snapshot()["kv_tier_dropped_writes"] == 2
    backend.release.set()


def test_bad_tier_arguments_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="list of tier URLs"):
        Engine(MODEL, kv_tiers=f"file://{tmp_path}")
    with pytest.raises(ConfigError, match="unknown scheme"):
        Engine(MODEL, kv_tiers=["s3://bucket"])
    with pytest.raises(ConfigError, match="prefix caching"):
        Engine(MODEL, kv_tiers=[f"file://{tmp_path}"], enable_prefix_caching=False)


@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "fp8_e4m3"])
def test_tier_blocks_of_a_lower_precision_pool_load_byte_for_byte(tmp_path, kv_dtype):
    url = f"file://{tmp_path}/tier"
    writer = Engine(MODEL, kv_tiers=[url], kv_cache_dtype=kv_dtype)
    a = run(writer, PROMPT)
    writer.close(30)
    follow = PROMPT + a.outputs[0].token_ids
    reader = Engine(MODEL, kv_tiers=[url], kv_cache_dtype=kv_dtype)
    b = run(reader, follow)
    local = Engine(MODEL, kv_cache_dtype=kv_dtype)  # the same blocks, computed and kept in one process
    run(local, PROMPT)
    assert b.num_cached_tokens == 96
    assert b.outputs[0].token_ids == run(local, follow).outputs[0].token_ids
    assert Engine(MODEL, kv_tiers=[url]).generate([follow], GREEDY)[0].num_cached_tokens == 0  # float64 pool
    reader.close(30)


def chain_names(prompt: list[int], count: int) -> list[str]:
    """Tier key names of the first `count` blocks of `prompt` for MODEL's unsalted float64 chain."""
    parent, names = root_key(MODEL.fingerprint, MODEL.dtype, MODEL.dtype), []
    for index in range(count):
        parent = block_key(parent, tuple(prompt[index * 16:(index + 1) * 16]))
        names.append(key_name(tier_key(parent, 16)))
    return names


def test_tiers_are_tried_in_order_and_the_second_continues_the_first(tmp_path):
    near_url, far_url = f"file://{tmp_path}/near", f"file://{tmp_path}/far"
    writer = Engine(MODEL, kv_tiers=[near_url, far_url])  # writes go to both
    run(writer, PROMPT)
    writer.close(30)
    near, far = FileTier(near_url), FileTier(far_url)
    names = chain_names(PROMPT, 5)
    assert near.run_length(names) == far.run_length(names) == 5
    for name in names[2:]:
        near._path(name).unlink()  # near holds blocks 0-1 only
    for name in names[:2]:
        far._path(name).unlink()   # far holds blocks 2-4 only: a hit of 5 needs both, in this order
    both = Engine(MODEL, kv_tiers=[near_url, far_url])
    out = run(both, PROMPT)
    assert out.num_cached_tokens == 80 and out.outputs[0].token_ids == cold(PROMPT)
    assert both.stats()["kv_tier_hit_blocks"] == 5
    both.close(30)
    reversed_order = Engine(MODEL, kv_tiers=[far_url, near_url])  # far misses block 0, near stops at 2
    assert run(reversed_order, PROMPT).num_cached_tokens == 32
    reversed_order.close(30)
