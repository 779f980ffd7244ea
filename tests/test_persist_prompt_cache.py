"""A prompt cache file reused and updated across runs (llama.cpp's --prompt-cache)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import kvlab
from kvlab import CacheMismatchError, InputError, Session, TinyLlama, generate
from kvlab.sessions.prompt_cache import generate_with_prompt_cache, open_prompt_cache

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


def test_stop_reasons_and_the_context_cap(tmp_path: Path) -> None:
    model = TinyLlama(seed=7, max_position_embeddings=16)
    run = generate_with_prompt_cache(model, PROMPT, tmp_path / "a.kvc", 100)  # capped at the context
    assert (len(run.new_tokens), run.stop_reason) == (16 - len(PROMPT), "context full")
    assert run.session.num_cached_tokens == 16
    run = generate_with_prompt_cache(model, PROMPT, tmp_path / "b.kvc", 2)
    assert run.stop_reason == "max tokens"
    free = run.new_tokens
    run = generate_with_prompt_cache(model, PROMPT, tmp_path / "c.kvc", 3, stop_token_ids=iter([free[0]]))
    assert (run.new_tokens, run.stop_reason) == (free[:1], "eos")
    with pytest.raises(InputError):
        generate_with_prompt_cache(model, PROMPT, tmp_path / "d.kvc", -1)
    run = generate_with_prompt_cache(model, PROMPT, tmp_path / "f.kvc", None)  # None: to the context end
    assert (len(run.new_tokens), run.stop_reason) == (16 - len(PROMPT), "context full")
    run = generate_with_prompt_cache(model, PROMPT, tmp_path / "e.kvc", 0)  # zero new tokens is allowed
    assert (run.new_tokens, run.stop_reason) == ([], "max tokens")
    assert Session.load(tmp_path / "e.kvc", model).tokens == PROMPT


@pytest.mark.parametrize("bad", [-1, 2.5, "3", True])
def test_bad_max_new_tokens_is_refused_before_the_file_is_read(model: TinyLlama, tmp_path: Path,
                                                               bad: object) -> None:
    path = tmp_path / "other.kvc"
    generate_with_prompt_cache(TinyLlama(seed=8), PROMPT, path, 1)  # would be a CacheMismatchError
    before = path.read_bytes()
    with pytest.raises(InputError, match=rf"^max_new_tokens must be .*, got .*{re.escape(repr(bad))}$"):
        generate_with_prompt_cache(model, PROMPT, path, bad)
    assert path.read_bytes() == before


def test_the_cache_dtype_is_used_for_new_files_and_checked_for_old_ones(model: TinyLlama,
                                                                        tmp_path: Path) -> None:
    path = tmp_path / "half.kvc"
    first = generate_with_prompt_cache(model, PROMPT, path, 3, kv_dtype="float16")
    assert first.session.cache.dtype == np.float16
    assert Session.load(path, model).cache.dtype == np.float16
    second = generate_with_prompt_cache(model, PROMPT, path, 3, kv_dtype="float16")
    assert second.restored == len(PROMPT) + 3 and second.session.cache.dtype == np.float16
    with pytest.raises(CacheMismatchError, match="float16 rows, float32 was asked for"):
        generate_with_prompt_cache(model, PROMPT, path, 3, kv_dtype="float32")
    assert open_prompt_cache(path, model, "float16").tokens == PROMPT + second.new_tokens


def test_kvlab_generate_prompt_cache_flag(tmp_path: Path) -> None:
    """`kvlab generate --prompt-cache FILE` twice: same text, and the second run reuses the saved prompt."""
    import re
    import subprocess
    import sys

    from test_chat import make_model_folder

    make_model_folder(tmp_path / "m", None)
    command = [sys.executable, "-m", "kvlab.cli", "generate", "--model", str(tmp_path / "m"), "-n", "6",
               "--temperature", "0", "--prompt-cache", str(tmp_path / "p.kvc"), "To be, or not to be"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120)
    second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout and first.stdout.strip()
    (n, cold), = re.findall(r"prompt (\d+) tokens \((\d+) cached\)", first.stderr)
    (n_again, warm), = re.findall(r"prompt (\d+) tokens \((\d+) cached\)", second.stderr)
    assert int(cold) == 0 and int(n_again) == int(n) and int(warm) == int(n) - 1 > 0  # all but the last token
    n = int(n)
    model, _ = kvlab.load(tmp_path / "m")
    assert len(Session.load(tmp_path / "p.kvc", model).tokens) == n + 5  # the last new token has no K/V yet
