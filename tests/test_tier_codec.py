"""The tier's keys and value codec, and the backends' contract (fakeredis only here; real Valkey elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvlab.cache.kv_cache import resolve_kv_dtype
from kvlab.cache.paged import BlockPool, write_slots
from kvlab.cache.dtypes import parse_quant_format
from kvlab.errors import ConfigError
from kvlab.prefix.block_hash import block_key, root_key
from kvlab.tier import block_io, codec
from kvlab.tier.file_tier import FileTier
from kvlab.tier.keys import key_name, tier_key
from kvlab.tier.url import open_backend
from serve_helpers import ROOT

TOKENS = tuple(range(100, 116))


def filled_pool(dtype=np.float32, num_blocks=4) -> BlockPool:
    pool = BlockPool(3, 2, 8, resolve_kv_dtype(dtype, np.float32), 16, num_blocks, compute_dtype=np.float32)
    rng = np.random.default_rng(0)
    for layer in range(3):
        keys = rng.standard_normal((16 * num_blocks, 2, 8)).astype(np.float32)
        values = rng.standard_normal((16 * num_blocks, 2, 8)).astype(np.float32)
        write_slots(pool.key_cache[layer], pool.value_cache[layer], np.arange(16 * num_blocks), keys, values)
    return pool


def expected_for(pool, key=b"k" * 32, parent=b"p" * 32, tokens=TOKENS) -> codec.Expected:
    return codec.Expected(key, parent, tokens, block_io.layout(pool), block_io.part_dtypes(pool))


def entry(pool, block=1, key=b"k" * 32, parent=b"p" * 32, tokens=TOKENS) -> bytes:
    return codec.encode(key, parent, tokens, block_io.layout(pool), block_io.read_block(pool, block))


# --- keys ------------------------------------------------------------------------------------------------
def test_tier_keys_bind_block_size_version_and_everything_in_the_chain():
    root = root_key("fp", np.float32, np.float32)
    chain = block_key(root, TOKENS)
    assert tier_key(chain, 16) == tier_key(chain, 16)
    assert tier_key(chain, 16) != tier_key(chain, 32)
    others = [root_key("fp2", np.float32, np.float32), root_key("fp", np.float64, np.float32),
              root_key("fp", np.float32, np.float16), root_key("fp", np.float32, np.float32, "tenant-a")]
    assert len({tier_key(block_key(r, TOKENS), 16) for r in [root, *others]}) == 5
    assert key_name(tier_key(chain, 16)).startswith("kvlab:kv:v1:")


def test_tier_keys_agree_across_processes():
    code = ("import numpy as np; from kvlab.prefix.block_hash import block_key, root_key; "
            "from kvlab.tier.keys import tier_key; "
            "print(tier_key(block_key(root_key('fp', np.float32, np.float32), tuple(range(100, 116))), 16).hex())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
                           cwd=ROOT).stdout.strip() for seed in ("1", "2")}
    here = tier_key(block_key(root_key("fp", np.float32, np.float32), TOKENS), 16).hex()
    assert runs == {here}


# --- codec -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", parse_quant_format("int8"), parse_quant_format("int4"), parse_quant_format("fp8")])
def test_codec_round_trips_every_layer_and_scale_byte_for_byte(dtype):
    pool = filled_pool(dtype)
    arrays = codec.decode(entry(pool), expected_for(pool))
    original = block_io.read_block(pool, 1)
    quantized = dtype not in (np.float32, np.float16, "bfloat16")
    assert len(arrays) == len(original) == 3 * 2 * (3 if quantized else 1)
    for got, want in zip(arrays, original):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    other = BlockPool(3, 2, 8, resolve_kv_dtype(dtype, np.float32), 16, 4, compute_dtype=np.float32)
    block_io.write_block(other, 2, arrays)
    for a, b in zip(block_io.read_block(other, 2), original):
        assert a.tobytes() == b.tobytes()


def test_codec_stores_no_pickle_and_a_readable_header():
    value = entry(filled_pool())
    assert value.startswith(codec.MAGIC) and b"pickle" not in value and b"\x80\x04" not in value[:64]
    assert b'"token_ids":[100,101' in value


def _flip(value: bytes, offset: int) -> bytes:
    return value[:offset] + bytes([value[offset] ^ 0x01]) + value[offset + 1:]


@pytest.mark.parametrize("damage, reason", [
    (lambda v: v[:-1], "truncated"),
    (lambda v: v[:len(v) // 2], "truncated"),
    (lambda v: v[:10], "truncated"),
    (lambda v: _flip(v, len(v) - 3), "SHA-256"),
    (lambda v: b"NOTKVLAB" + v[8:], "bad magic"),
    (lambda v: v[:8] + b"\x07\x00" + v[10:], "format version 7"),
    (lambda v: v[:10] + b"\xff\xff\xff\x7f" + v[14:], "truncated"),
    (lambda v: v.replace(b'"token_ids":[100', b'"token_ids":[{}0', 1), "not JSON"),
    (lambda v: b"", "truncated"),
])
def test_codec_refuses_corrupt_truncated_and_foreign_entries(damage, reason):
    pool = filled_pool()
    with pytest.raises(codec.TierEntryError, match=reason):
        codec.decode(damage(entry(pool)), expected_for(pool))


def test_codec_refuses_another_block_model_or_dtype():
    pool = filled_pool()
    value = entry(pool)
    with pytest.raises(codec.TierEntryError, match="another key"):
        codec.decode(value, expected_for(pool, key=b"x" * 32))
    with pytest.raises(codec.TierEntryError, match="another parent"):
        codec.decode(value, expected_for(pool, parent=b"x" * 32))
    with pytest.raises(codec.TierEntryError, match="token ids differ"):
        codec.decode(value, expected_for(pool, tokens=TOKENS[:-1] + (7,)))
    for other in (filled_pool(np.float16), BlockPool(2, 2, 8, np.float32, 16, 4), BlockPool(3, 1, 8, np.float32, 16, 4)):
        with pytest.raises(codec.TierEntryError, match="foreign layout"):
            codec.decode(value, expected_for(other))


# --- backends ------------------------------------------------------------------------------------------
def test_file_tier_writes_atomically_once_and_reads_runs(tmp_path):
    tier = open_backend(f"file://{tmp_path}/tier")
    assert isinstance(tier, FileTier)
    assert tier.put("kvlab:kv:v1:aa", b"one") and not tier.put("kvlab:kv:v1:aa", b"two")
    assert tier.put("kvlab:kv:v1:bb", b"three")
    assert tier.run_length(["kvlab:kv:v1:aa", "kvlab:kv:v1:bb", "kvlab:kv:v1:cc", "kvlab:kv:v1:aa"]) == 2
    assert tier.get_many(["kvlab:kv:v1:aa", "kvlab:kv:v1:cc"]) == [b"one", None]
    assert not list((tmp_path / "tier").rglob("*.tmp"))


def test_redis_tier_contract_on_fakeredis():
    fakeredis = pytest.importorskip("fakeredis")
    tier = open_backend("valkey://127.0.0.1:6399/0?ttl=60&timeout=0.5&retry=0")
    tier.client = fakeredis.FakeRedis()
    assert tier.put("a", b"1") and not tier.put("a", b"2") and tier.put("b", b"3")
    assert 0 < tier.client.ttl("a") <= 60
    assert tier.run_length(["a", "b", "c", "a"]) == 2
    assert tier.get_many(["a", "c", "b"]) == [b"1", None, b"3"]
    assert (tier.ttl, tier.timeout, tier.retry_s) == (60, 0.5, 0.0)
    plain = open_backend("redis://127.0.0.1:6399/2").client.connection_pool
    secure = open_backend("rediss://127.0.0.1:6399/2").client.connection_pool
    assert plain.connection_class.__name__ == "Connection" and "SSL" in secure.connection_class.__name__
    assert plain.connection_kwargs["db"] == 2


@pytest.mark.parametrize("url, match", [
    ("memcached://x", "unknown scheme"), ("no-scheme", "expected"), ("redis://h:1/0?ttl=-1", "ttl"),
    ("redis://h:1/0?bogus=1", "unknown parameter"), ("redis://h:1/zero", "numbers"),
    ("redis://h:1/0?timeout=nan", "timeout"), ("file://relative/dir", "file:///"), ("file:///tmp/x?a=1", "no parameters"),
])
def test_bad_tier_urls_are_refused_by_name(url, match):
    with pytest.raises(ConfigError, match=match):
        open_backend(url)
