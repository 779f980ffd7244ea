"""The session-file checksum on files of several MB: a change anywhere (past 64 KiB, near the end, in the
header) is refused. A digest over only the first block(s) of the file passes every test on a 2 KB file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlab import CheckpointError, LlamaModel, ModelConfig, Session

# 2 layers x 8 KV heads x head_dim 64 x float64 x (K+V) = 16 KiB per token: 320 tokens make a 5 MiB file
CONFIG = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=512)
TOKENS = [int(t) for t in np.random.default_rng(5).integers(0, 300, size=320)]


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> tuple[LlamaModel, Path, bytes, Session]:
    model = LlamaModel(CONFIG, dtype=np.float64, seed=2)
    session = Session(model)
    session.feed(TOKENS)
    session.extra = {"note": "large"}
    path = tmp_path_factory.mktemp("large") / "big.kvc"
    session.save(path)
    return model, path, path.read_bytes(), session


def header_length(blob: bytes) -> int:
    return 8 + int.from_bytes(blob[:8], "little")


def test_the_file_is_several_megabytes_and_loads(big_file) -> None:
    model, path, blob, session = big_file
    assert len(blob) > 5 * 2**20
    restored = Session.load(path, model)
    assert restored.tokens == TOKENS and restored.extra == {"note": "large"}
    for (k1, v1), (k2, v2) in zip(session.cache, restored.cache):
        assert k1.tobytes() == k2.tobytes() and v1.tobytes() == v2.tobytes()


def flip_positions(blob: bytes) -> list[int]:
    size, head = len(blob), header_length(blob)
    rng = np.random.default_rng(0)
    spread = rng.integers(head, size, size=24).tolist()  # anywhere in the payload
    return sorted({
        0, 7, 8, head // 2, head - 1,                        # the length prefix and the JSON header
        head, 64 * 1024, 64 * 1024 + 1, 2**20 + 3,          # first payload byte, just past 64 KiB, 1 MiB
        size // 2, size - 4096, size - 9, size - 2, size - 1,  # near the end
        *spread})


def test_a_flipped_byte_anywhere_is_refused(big_file, tmp_path: Path) -> None:
    model, _, blob, _ = big_file
    damaged = tmp_path / "damaged.kvc"
    missed = []
    for i in flip_positions(blob):
        changed = bytearray(blob)
        changed[i] ^= 0x04
        damaged.write_bytes(bytes(changed))
        try:
            Session.load(damaged, model)
            missed.append(i)
        except CheckpointError:
            pass
    assert missed == [], f"flipped bytes not detected at offsets {missed} of {len(blob)}"


def test_swapped_payload_rows_and_a_cut_tail_are_refused(big_file, tmp_path: Path) -> None:
    model, _, blob, _ = big_file
    damaged = tmp_path / "damaged.kvc"
    at = len(blob) - 3 * 4096  # two 8-byte floats swapped near the end: same bytes, another order
    changed = bytearray(blob)
    changed[at:at + 8], changed[at + 8:at + 16] = blob[at + 8:at + 16], blob[at:at + 8]
    assert changed != blob
    damaged.write_bytes(bytes(changed))
    with pytest.raises(CheckpointError, match="checksum"):
        Session.load(damaged, model)
    damaged.write_bytes(blob[:-8] + bytes(8))  # the last float zeroed
    with pytest.raises(CheckpointError, match="checksum"):
        Session.load(damaged, model)
