"""Session files whose checksum is right but whose contents are wrong, and KVCache.from_arrays' checks.

The checksum only says the bytes are the ones written; a file written by a buggy or hostile writer can be
consistent and still wrong. Each case here re-signs a tampered file (recomputing its digest with the same
rule the writer uses), so the reader's validation itself is what must refuse it, with a CheckpointError.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from kvlab import CacheMismatchError, CheckpointError, InputError, KVCache, Session, TinyLlama
from kvlab.sessions import persist

MODEL = TinyLlama(seed=7)  # vocab 260, 2 layers, 2 KV heads, head_dim 8
TOKENS = [256, 5, 9, 259, 0]


def session_file(tmp_path: Path) -> Path:
    session = Session(MODEL)
    session.feed(TOKENS)
    path = tmp_path / "good.kvc"
    session.save(path)
    return path


def resign(path: Path, out: Path, change) -> Path:
    """Rewrite `path` with `change(meta)` applied to its kvlab metadata and a valid digest."""
    with safe_open(str(path), "np") as f:
        meta = json.loads(f.metadata()["kvlab"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    change(meta)
    blob = bytearray(safetensors.numpy.save(tensors, metadata={"kvlab": json.dumps(meta),
                                                               "sha256": "0" * 64}))
    span = persist._digest_span(blob, 8 + int.from_bytes(blob[:8], "little"), "0" * 64)
    blob[span[0]:span[1]] = persist._sha256_zeroed(blob, span).encode()
    out.write_bytes(bytes(blob))
    return out


def test_resigning_an_unchanged_file_loads(tmp_path: Path) -> None:
    same = resign(session_file(tmp_path), tmp_path / "same.kvc", lambda meta: None)
    saved = persist.read_session_file(same, MODEL)
    assert saved.tokens == TOKENS and saved.cache.get_seq_length() == 5


def set_key(key, value):
    return lambda meta: meta.__setitem__(key, value)


@pytest.mark.parametrize("change, message", [
    (set_key("tokens", [256, 5, 9, 259]), "token ids or positions are not 5 valid ints"),
    (set_key("tokens", [256, 5, 9, 259, 0, 1]), "token ids or positions"),
    (set_key("tokens", None), "token ids or positions"),
    (set_key("tokens", "abcde"), "token ids or positions"),
    (set_key("tokens", [256, 5, -1, 259, 0]), "token ids or positions"),
    (set_key("tokens", [256, 5, 9, 260, 0]), "token ids or positions"),  # == vocab_size: out of range
    (set_key("tokens", [256, 5, 9.0, 259, 0]), "token ids or positions"),
    (set_key("tokens", [256, 5, True, 259, 0]), "token ids or positions"),
    (set_key("positions", [0, 1, 2, 3]), "token ids or positions"),
    (set_key("positions", [0, 1, -2, 3, 4]), "token ids or positions"),
    (set_key("positions", {"0": 0}), "token ids or positions"),
    (set_key("num_tokens", 4), "token ids or positions|shape"),
    (set_key("num_tokens", "5"), "cache shape does not match the model"),
    (set_key("num_tokens", 2049), "cache shape does not match the model"),
    (set_key("head_dim", 4), "cache shape does not match the model"),
    (set_key("extra", []), "extra data is not a JSON object"),
    (set_key("version", 2), "session format version 2; this kvlab reads version 1"),
    (set_key("format", "other"), "not a kvlab session file"),
    (set_key("kv_dtype", "float7"), "unknown cache dtype 'float7'"),
    (set_key("kv_dtype", "float32"), "tensor 'layers.0.keys' is not float32|is not float32"),
])
def test_consistent_but_wrong_metadata_is_refused(tmp_path: Path, change, message: str) -> None:
    bad = resign(session_file(tmp_path), tmp_path / "bad.kvc", change)
    with pytest.raises(CheckpointError, match=message):
        persist.read_session_file(bad, MODEL)
    with pytest.raises(CheckpointError):
        Session.load(bad, MODEL)


# --- KVCache.from_arrays ---------------------------------------------------------------------------------

def arrays(length: int = 5, dtype=np.float64, heads: int = 2, dim: int = 8):
    rng = np.random.default_rng(length)
    keys = [rng.standard_normal((1, heads, length, dim)).astype(dtype) for _ in range(2)]
    values = [rng.standard_normal((1, heads, length, dim)).astype(dtype) for _ in range(2)]
    return keys, values


def test_from_arrays_keeps_the_arrays_dtype_unless_told() -> None:
    keys, values = arrays(dtype=np.float32)
    cache = KVCache.from_arrays(MODEL.cache_spec, keys, values, np.arange(5))
    assert cache.dtype == np.float32 and cache.get_seq_length() == 5
    assert cache[1][0].tobytes() == keys[1].tobytes()
    half = KVCache.from_arrays(MODEL.cache_spec, keys, values, np.arange(5), kv_dtype="float16")
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half[0][1], values[0].astype(np.float16))
    mixed = KVCache.from_arrays(MODEL.cache_spec, [keys[0], keys[1].astype(np.float64)], values,
                                np.arange(5))
    assert mixed.dtype == np.float32  # the first layer's keys decide


@pytest.mark.parametrize("build, message", [
    (lambda k, v: (k[:1], v, np.arange(5)), "expected 2 layers of keys and values, got 1 and 2"),
    (lambda k, v: (k, v + v, np.arange(5)), "expected 2 layers of keys and values, got 2 and 4"),
    (lambda k, v: ([k[0][0], k[1]], v, np.arange(5)), r"keys must be \[B, 2, T, 8\], got \[2, 5, 8\]"),
    (lambda k, v: ([np.ones((1, 3, 5, 8)), k[1]], v, np.arange(5)),
     r"keys must be \[B, 2, T, 8\], got \[1, 3, 5, 8\]"),
    (lambda k, v: ([np.ones((1, 2, 5, 4)), k[1]], v, np.arange(5)), r"got \[1, 2, 5, 4\]"),
    (lambda k, v: (k, [v[0], v[1][:, :, :4]], np.arange(5)), "^every layer's keys and values must have "
                                                              "the same shape$"),
    (lambda k, v: (k, v, np.arange(4)), r"positions must be 5 ints, got int64 \[4\]"),
    (lambda k, v: (k, v, np.arange(5.0)), r"positions must be 5 ints, got float64 \[5\]"),
])
def test_from_arrays_names_the_problem(build, message: str) -> None:
    keys, values = arrays()
    with pytest.raises(InputError, match=message):
        KVCache.from_arrays(MODEL.cache_spec, *build(keys, values))


# --- what the writer puts in the file --------------------------------------------------------------------

def test_the_metadata_is_canonical_json_and_names_the_compute_dtype(tmp_path: Path) -> None:
    model = TinyLlama(seed=7, dtype=np.float32)
    session = Session(model)
    session.feed(TOKENS)
    session.extra = {"zeta": 1, "alpha": "héllo ☃"}
    session.save(tmp_path / "f32.kvc")
    with safe_open(str(tmp_path / "f32.kvc"), "np") as f:
        raw = f.metadata()["kvlab"]
    meta = json.loads(raw)
    assert raw == json.dumps(meta, sort_keys=True, ensure_ascii=False, allow_nan=False)  # sorted, UTF-8
    assert "héllo ☃" in raw
    assert (meta["compute_dtype"], meta["kv_dtype"]) == ("float32", "float32")
    assert Session.load(tmp_path / "f32.kvc", model).tokens == TOKENS


def test_the_writer_refuses_what_it_cannot_write_faithfully(tmp_path: Path) -> None:
    session = Session(MODEL)
    session.feed(TOKENS)
    with pytest.raises(InputError, match="^a session file holds one sequence with one row per token; got "
                                         "batch 1, 5 rows and 4 tokens$"):
        persist.write_session_file(tmp_path / "x.kvc", session.cache, TOKENS[:4], {})
    batch = MODEL.new_cache(batch_size=2)
    MODEL.forward(np.array([TOKENS, TOKENS]), cache=batch)
    with pytest.raises(InputError, match="got batch 2, 5 rows and 5 tokens"):
        persist.write_session_file(tmp_path / "x.kvc", batch, TOKENS, {})
    with pytest.raises(InputError, match="^session extra"):
        persist.write_session_file(tmp_path / "x.kvc", session.cache, TOKENS, {"x": float("nan")})
    assert not (tmp_path / "x.kvc").exists()


# --- the checksum field itself ---------------------------------------------------------------------------

def test_checksum_field_problems_are_named(tmp_path: Path) -> None:
    good = session_file(tmp_path)
    blob = good.read_bytes()
    with safe_open(str(good), "np") as f:
        digest = f.metadata()["sha256"]
    bad = tmp_path / "bad.kvc"
    for replacement in ["X" * 64, digest.upper()]:  # same length: the header stays valid JSON
        bad.write_bytes(blob.replace(digest.encode(), replacement.encode()))
        with pytest.raises(CheckpointError, match=rf"^{bad}: corrupt checksum field$"):
            Session.load(bad, MODEL)
    with safe_open(str(good), "np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        meta = dict(f.metadata())
    safetensors.numpy.save_file(tensors, bad, metadata={**meta, "sha256": digest[:63]})
    with pytest.raises(CheckpointError, match=rf"^{bad}: corrupt checksum field$"):
        Session.load(bad, MODEL)
    # a header written by another tool with spaces after the colons: the digest field cannot be located
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + header_len])
    spaced = json.dumps(header).encode()
    bad.write_bytes(len(spaced).to_bytes(8, "little") + spaced + blob[8 + header_len:])
    with pytest.raises(CheckpointError, match=rf"^{bad}: the checksum field is missing or ambiguous$"):
        Session.load(bad, MODEL)
    changed = bytearray(blob)
    changed[-1] ^= 1
    bad.write_bytes(bytes(changed))
    with pytest.raises(CheckpointError, match=rf"^{bad}: checksum mismatch: the file was truncated, "
                                              "corrupted or modified after it was written$"):
        Session.load(bad, MODEL)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}: cannot read \(Is a directory\)$"):
        Session.load(tmp_path, MODEL)


def test_unreadable_metadata_and_another_compute_dtype_are_named(tmp_path: Path) -> None:
    good = session_file(tmp_path)
    with safe_open(str(good), "np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    blob = bytearray(safetensors.numpy.save(tensors, metadata={"kvlab": "{not json", "sha256": "0" * 64}))
    span = persist._digest_span(blob, 8 + int.from_bytes(blob[:8], "little"), "0" * 64)
    blob[span[0]:span[1]] = persist._sha256_zeroed(blob, span).encode()
    (tmp_path / "meta.kvc").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'meta.kvc'}: corrupt metadata \("):
        persist.read_session_file(tmp_path / "meta.kvc", MODEL)
    with pytest.raises(CacheMismatchError, match=rf"^{good}: cache computed in float64, the model runs in "
                                                 "float32$"):
        persist.read_session_file(good, TinyLlama(seed=7, dtype=np.float32))


def test_another_model_or_cache_dtype_is_named_exactly(tmp_path: Path) -> None:
    good = session_file(tmp_path)
    other = TinyLlama(seed=8)
    with pytest.raises(CacheMismatchError, match=(
            rf"^{good}: saved by a different model \(fingerprint {MODEL.fingerprint[:12]} vs "
            rf"{other.fingerprint[:12]}\): cached keys and values are valid only for the exact weights, "
            "config and dtype$")):
        persist.read_session_file(good, other)
    with pytest.raises(CacheMismatchError, match=(
            rf"^{good}: the file holds float64 rows, float16 was asked for; converting would change the "
            "numbers the rows were computed with$")):
        persist.read_session_file(good, MODEL, "float16")


def test_missing_or_extra_tensors_are_named(tmp_path: Path) -> None:
    good = session_file(tmp_path)
    with safe_open(str(good), "np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        meta = dict(f.metadata())
    del tensors["layers.1.values"]
    blob = bytearray(safetensors.numpy.save(tensors, metadata={**meta, "sha256": "0" * 64}))
    span = persist._digest_span(blob, 8 + int.from_bytes(blob[:8], "little"), "0" * 64)
    blob[span[0]:span[1]] = persist._sha256_zeroed(blob, span).encode()
    (tmp_path / "t.kvc").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 't.kvc'}: expected tensors "
                                              r"layers\.0\.\.1\.keys/values$"):
        persist.read_session_file(tmp_path / "t.kvc", MODEL)
