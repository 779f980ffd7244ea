"""Session files: round trip, restore-then-hit, and refusal of other models, dtypes and damaged files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from kvlab import CacheMismatchError, CheckpointError, InputError, KVCache, Session, TinyLlama
from kvlab.sessions import persist

TOL = 1e-10
HISTORY = [1, 7, 7, 3, 9, 4, 2, 8, 5, 6, 3, 1, 2]


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(seed=7)


@pytest.fixture()
def saved(model: TinyLlama, tmp_path: Path) -> Path:
    session = Session(model)
    session.feed(HISTORY)
    session.extra = {"messages": [{"role": "user", "content": "héllo"}]}
    path = tmp_path / "chat.kvc"
    session.save(path)
    return path


def full_logits(model: TinyLlama, tokens: list[int]) -> np.ndarray:
    return model.forward(np.array([tokens])).logits[0, -1]


@pytest.mark.parametrize("kv_dtype", [None, "float32", "float16", "bfloat16"])
def test_round_trip_is_bit_exact(model: TinyLlama, tmp_path: Path, kv_dtype: str | None) -> None:
    session = Session(model, kv_dtype=kv_dtype)
    session.feed(HISTORY)
    session.extra = {"note": [1, 2.5, None, "x"]}
    session.save(tmp_path / "s.kvc")
    restored = Session.load(tmp_path / "s.kvc", model)
    assert restored.tokens == HISTORY and restored.extra == session.extra
    assert restored.cache.dtype == session.cache.dtype
    assert restored.cache.positions.tolist() == list(range(len(HISTORY)))
    for (k1, v1), (k2, v2) in zip(session.cache, restored.cache):
        assert k1.tobytes() == k2.tobytes() and v1.tobytes() == v2.tobytes()
    assert restored.memory_report().payload_bytes == session.memory_report().payload_bytes


def test_restore_then_hit(model: TinyLlama, saved: Path) -> None:
    """llama.cpp #26676: restore must rebuild what the prefix matcher reads, so the next turn reuses it."""
    session = Session.load(saved, model)
    longer = HISTORY + [4, 4, 2]
    turn = session.feed(longer)
    assert (turn.reused, turn.computed) == (len(HISTORY), 3)
    np.testing.assert_allclose(turn.logits, full_logits(model, longer), rtol=0, atol=TOL)

    again = Session.load(saved, model).feed(HISTORY)  # identical: the last token is recomputed for logits
    assert (again.reused, again.computed) == (len(HISTORY) - 1, 1)
    np.testing.assert_allclose(again.logits, full_logits(model, HISTORY), rtol=0, atol=TOL)


def test_restore_then_generate_equals_an_uninterrupted_session(model: TinyLlama, saved: Path) -> None:
    live = Session(model)
    live.feed(HISTORY)
    restored = Session.load(saved, model)
    assert restored.generate(6) == live.generate(6)
    np.testing.assert_allclose(restored.logits, live.logits, rtol=0, atol=TOL)


def test_empty_session_round_trips(model: TinyLlama, tmp_path: Path) -> None:
    Session(model).save(tmp_path / "empty.kvc")
    session = Session.load(tmp_path / "empty.kvc", model)
    assert session.tokens == [] and session.feed(HISTORY).computed == len(HISTORY)


def test_the_file_is_plain_safetensors(saved: Path) -> None:
    """No pickle: any safetensors reader can open the payload; the metadata is JSON."""
    tensors = safetensors.numpy.load_file(saved)
    assert sorted(tensors) == [f"layers.{i}.{kind}" for i in range(2) for kind in ("keys", "values")]
    assert tensors["layers.0.keys"].shape == (1, 2, len(HISTORY), 8)
    header = json.loads(saved.read_bytes()[8: 8 + int.from_bytes(saved.read_bytes()[:8], "little")])
    meta = json.loads(header["__metadata__"]["kvlab"])
    assert meta["tokens"] == HISTORY and meta["version"] == persist.VERSION
    assert meta["kv_dtype"] == "float64" and len(header["__metadata__"]["sha256"]) == 64


@pytest.mark.parametrize("other", [
    lambda: TinyLlama(seed=8),                          # other weights
    lambda: TinyLlama(seed=7, dtype=np.float32),        # other compute dtype
    lambda: TinyLlama(seed=7, rope_theta=500000.0),     # other config, same weights
])
def test_other_models_are_refused(saved: Path, other) -> None:
    with pytest.raises(CacheMismatchError):
        Session.load(saved, other())


def test_other_cache_dtype_is_refused(model: TinyLlama, saved: Path) -> None:
    with pytest.raises(CacheMismatchError):
        Session.load(saved, model, kv_dtype="float16")
    assert Session.load(saved, model, kv_dtype="float64").tokens == HISTORY


def test_every_changed_byte_is_caught(model: TinyLlama, tmp_path: Path) -> None:
    session = Session(model)
    session.feed(HISTORY[:3])
    session.extra = {"messages": ["hi"]}
    session.save(tmp_path / "small.kvc")
    blob = (tmp_path / "small.kvc").read_bytes()
    damaged = tmp_path / "damaged.kvc"
    missed = []
    for i in range(len(blob)):
        flip = (0x01, 0x80, 0x10)[i % 3]  # one flip per byte, low, high and middle bits in turn
        changed = bytearray(blob)
        changed[i] ^= flip
        damaged.write_bytes(bytes(changed))
        try:  # (pytest.raises in a loop of thousands is slow)
            Session.load(damaged, model)
            missed.append((i, flip))
        except CheckpointError:
            pass
    assert missed == []


def test_truncated_and_extended_files_are_refused(model: TinyLlama, saved: Path, tmp_path: Path) -> None:
    blob = saved.read_bytes()
    damaged = tmp_path / "cut.kvc"
    for size in [0, 3, 8, 9, 100, len(blob) // 2, len(blob) - 65, len(blob) - 1]:
        damaged.write_bytes(blob[:size])
        with pytest.raises(CheckpointError):
            Session.load(damaged, model)
    damaged.write_bytes(blob + b"\0")
    with pytest.raises(CheckpointError):
        Session.load(damaged, model)


def test_other_files_are_refused(model: TinyLlama, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such"):
        Session.load(tmp_path / "missing.kvc", model)
    plain = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"x": np.zeros(3)}, plain)
    with pytest.raises(CheckpointError, match="not a kvlab session"):
        Session.load(plain, model)
    (tmp_path / "text.kvc").write_text("hello world, not a cache")
    with pytest.raises(CheckpointError):
        Session.load(tmp_path / "text.kvc", model)


def test_a_failed_save_leaves_the_old_file_and_no_temp_files(model: TinyLlama, saved: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    before = saved.read_bytes()
    session = Session(model)
    session.feed([3, 4, 5])
    session.extra = {"bad": object()}
    with pytest.raises(InputError):
        session.save(saved)

    session.extra = {}

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    temps = []

    def crash_after_recording(source, target):
        temps.append((Path(source), Path(target), Path(source).read_bytes()))
        crash()

    monkeypatch.setattr(persist.os, "replace", crash_after_recording)
    with pytest.raises(CheckpointError, match=rf"^{saved}: cannot write \(No space left on device\)$"):
        session.save(saved)
    assert saved.read_bytes() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]
    # the new bytes went to a hidden temp file beside the target (same filesystem, so the rename is atomic)
    (source, target, written), = temps
    assert target == saved and source.parent == saved.parent
    assert source.name.startswith(f".{saved.name}.") and source.name.endswith(".tmp") and written
    missing = saved.parent / "no-such-folder" / "x.kvc"
    with pytest.raises(CheckpointError, match=rf"^{missing}: cannot write \(No such file or directory\)$"):
        session.save(missing)


def test_save_overwrites_atomically(model: TinyLlama, saved: Path) -> None:
    session = Session.load(saved, model)
    session.feed(HISTORY + [9, 9])
    session.save(saved)
    assert Session.load(saved, model).tokens == HISTORY + [9, 9]
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


def test_positions_must_start_at_zero_for_a_session(model: TinyLlama, tmp_path: Path) -> None:
    cache = model.new_cache()
    model.forward(np.array([HISTORY]), cache=cache)
    shifted = KVCache.from_arrays(cache.spec, [k for k, _ in cache], [v for _, v in cache],
                                  np.arange(len(HISTORY)) + 5)
    persist.write_session_file(tmp_path / "shifted.kvc", shifted, HISTORY, {})
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'shifted.kvc'}: positions are not 0..12; a "
                                              "session cache always starts at position 0$"):
        Session.load(tmp_path / "shifted.kvc", model)


def test_from_arrays_rebuilds_a_working_cache(model: TinyLlama) -> None:
    cache = model.new_cache()
    model.forward(np.array([HISTORY[:-1]]), cache=cache)
    keys, values = [np.array(k) for k, _ in cache], [np.array(v) for _, v in cache]
    rebuilt = KVCache.from_arrays(cache.spec, keys, values, cache.positions, cache.dtype)
    assert rebuilt.get_seq_length() == len(HISTORY) - 1
    logits = model.forward(np.array([HISTORY[-1:]]), cache=rebuilt).logits[0, -1]
    np.testing.assert_allclose(logits, full_logits(model, HISTORY), rtol=0, atol=TOL)
    with pytest.raises(InputError):
        KVCache.from_arrays(cache.spec, [k for k, _ in cache][:1], [v for _, v in cache], cache.positions)
    with pytest.raises(InputError):
        KVCache.from_arrays(cache.spec, [k for k, _ in cache], [v for _, v in cache], cache.positions[:-1])


def test_no_stray_files_after_many_saves(model: TinyLlama, tmp_path: Path) -> None:
    session = Session(model)
    for n in range(1, 6):
        session.feed(HISTORY[:n])
        session.save(tmp_path / "s.kvc")
    assert os.listdir(tmp_path) == ["s.kvc"]
