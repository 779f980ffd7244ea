"""A prompt cache file reused and updated across runs (llama.cpp's --prompt-cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab import CacheMismatchError, InputError, Session, TinyLlama, generate
from kvlab.prefix.prompt_cache import generate_with_prompt_cache, open_prompt_cache

PROMPT = [256, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(seed=7)


def test_second_run_reuses_the_file_and_gives_the_same_tokens(model: TinyLlama, tmp_path: Path) -> None:
    path = tmp_path / "prompt.kvc"
    cold = generate(model, [PROMPT], 8)[0].tolist()
    first = generate_with_prompt_cache(model, PROMPT, path, 8)
    assert (first.restored, first.turn.reused, first.turn.computed) == (0, 0, len(PROMPT))
    assert first.new_tokens == cold
    assert Session.load(path, model).tokens == PROMPT + cold  # updated with what was generated

    second = generate_with_prompt_cache(model, PROMPT, path, 8)
    assert second.restored == len(PROMPT) + 8
    assert (second.turn.reused, second.turn.computed) == (len(PROMPT) - 1, 1)  # last token recomputed
    assert second.new_tokens == cold

    longer = PROMPT + cold + [33, 32]
    third = generate_with_prompt_cache(model, longer, path, 4, temperature=0.7, seed=1)
    assert (third.turn.reused, third.turn.computed) == (len(PROMPT) + 8, 2)
    assert third.new_tokens == generate(model, [longer], 4, temperature=0.7, seed=1)[0].tolist()


def test_streaming_callback(model: TinyLlama, tmp_path: Path) -> None:
    seen: list[int] = []
    run = generate_with_prompt_cache(model, PROMPT, tmp_path / "p.kvc", 5, on_token=seen.append)
    assert seen == run.new_tokens and len(seen) == 5


def test_a_file_from_another_model_is_refused_and_kept(model: TinyLlama, tmp_path: Path) -> None:
    path = tmp_path / "prompt.kvc"
    generate_with_prompt_cache(model, PROMPT, path, 3)
    before = path.read_bytes()
    with pytest.raises(CacheMismatchError):
        generate_with_prompt_cache(TinyLlama(seed=8), PROMPT, path, 3)
    assert path.read_bytes() == before


def test_a_bad_prompt_fails_before_any_work(model: TinyLlama, tmp_path: Path) -> None:
    path = tmp_path / "prompt.kvc"
    with pytest.raises(InputError):
        generate_with_prompt_cache(model, [1, 999], path, 3)
    assert not path.exists()
    assert open_prompt_cache(path, model).tokens == []
