"""`--kv-tier` on `kvlab generate` and `kvlab chat`: a second process reuses what the first wrote.

The CLI runs on the engine, so the server's shared K/V tier (kvlab/tier) reaches the commands too: the
first process stores each full block of its prompt in a file:// tier as it computes it, the second finds
them on its local miss and loads them instead of computing them, and prints the same text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_chat import CHATML, make_model_folder

PROMPT = " ".join(f"word{i % 37} of line {i // 7}," for i in range(120))  # ~400 tokens of this tokenizer
CACHED = re.compile(r"prompt (\d+) tokens \((\d+) cached\)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tier") / "m"
    make_model_folder(path, CHATML, max_position_embeddings=1024)
    return path


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "kvlab.cli", *args], input=stdin, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_a_second_generate_process_reuses_the_prompt_from_a_disk_tier(folder: Path, tmp_path: Path) -> None:
    command = ["generate", "--model", str(folder), "-n", "8", "--temperature", "0", "--kv-tier",
               f"file://{tmp_path / 'tier'}", PROMPT]
    first, second = run(*command), run(*command)
    (n, cold), = CACHED.findall(first.stderr)
    (n_again, warm), = CACHED.findall(second.stderr)
    assert int(n) >= 400 and int(cold) == 0 and n_again == n
    assert int(warm) >= 0.9 * int(n), second.stderr  # every whole block of the prompt came from the tier
    assert second.stdout == first.stdout and first.stdout.strip()
    assert list((tmp_path / "tier").rglob("*")), "nothing was written to the tier"


def test_a_second_chat_process_reuses_the_first_turn_from_a_disk_tier(folder: Path, tmp_path: Path) -> None:
    command = ["chat", "--model", str(folder), "-n", "6", "--temperature", "0", "--kv-tier",
               f"file://{tmp_path / 'tier'}"]
    first, second = run(*command, stdin=PROMPT + "\n"), run(*command, stdin=PROMPT + "\n")
    (n, cold), = CACHED.findall(first.stderr)
    (n_again, warm), = CACHED.findall(second.stderr)
    assert int(n) >= 400 and int(cold) == 0 and n_again == n
    assert int(warm) >= 0.9 * int(n), second.stderr
    assert second.stdout == first.stdout and first.stdout.strip()


def test_without_the_tier_a_second_process_computes_everything(folder: Path) -> None:
    """The control: the reuse above is the tier's, not something else surviving the process."""
    command = ["generate", "--model", str(folder), "-n", "2", "--temperature", "0", PROMPT]
    run(*command)
    (_, warm), = CACHED.findall(run(*command).stderr)
    assert int(warm) == 0
