"""`--speculative-config` on `kvlab generate`, `kvlab chat` and `kvlab serve`, as a user runs them (real
subprocesses on the shipped model): a bad config exits 2 naming its field before any model loads; with a
good one the text is the text without it (greedy and seeded sampling, an int8 cache, a draft model), and the
stats line adds what was drafted and accepted."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from kvlab.hf import DEFAULT_MODEL_DIR

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 5})
# copy-heavy: the continuation of a repeated line is found by prompt lookup
PROMPT = ("To be, or not to be, that is the question. To be, or not to be, that is the question. "
          "To be, or not to be,")


def kvlab(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True, input=stdin,
                          timeout=600)


def spec_counts(stderr: str) -> list[tuple[int, int]]:
    """Every (drafted, accepted) a stats line reports."""
    return [(int(d), int(a)) for d, a in re.findall(r"drafted (\d+), accepted (\d+) \(", stderr)]


# --- bad configs: exit 2, one line naming the field, nothing loaded ------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("flag, spec, field", [
    ("--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}', "method"),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ("--speculative_config", '{"method": "ngram", "num_speculative_tokens": 3', "not valid JSON"),
    ("--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3, "model": "/no/such/draft"}',
     "speculative_config.model: /no/such/draft does not exist"),
])
def test_a_bad_config_exits_2_naming_the_field_before_loading(command, flag, spec, field):
    # the target model does not exist either: the config is refused first, so nothing was loaded
    args = [command, "--model", "/no/such/target", flag, spec] + (["x"] if command == "generate" else [])
    proc = kvlab(*args, stdin="")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvlab {command}: error: --speculative-config: "), lines
    assert field in lines[0] and "/no/such/target" not in lines[0]


def test_the_prompt_cache_works_with_speculation(tmp_path):
    """Once refused (the prompt cache was the contiguous path's), now both run on the engine: the second run
    restores the file into the prefix cache, reuses all but the last prompt token and prints the same text."""
    common = ["generate", "--dtype", "float64", "-n", "24", "--ignore-eos", "--temperature", "0", PROMPT]
    plain = kvlab(*common)
    first = kvlab(*common, "--speculative-config", NGRAM, "--prompt-cache", str(tmp_path / "p.kv"))
    second = kvlab(*common, "--speculative-config", NGRAM, "--prompt-cache", str(tmp_path / "p.kv"))
    assert plain.returncode == first.returncode == second.returncode == 0, second.stderr
    assert plain.stdout == first.stdout == second.stdout
    (n, warm), = re.findall(r"prompt (\d+) tokens \((\d+) cached\)", second.stderr)
    assert int(warm) == int(n) - 1 > 0


# --- kvlab generate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [["--temperature", "0"], ["--temperature", "0.8", "--seed", "3"]],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("kv", [[], ["--kv-cache-dtype", "int8"]], ids=["exact", "int8"])
def test_generate_prints_the_same_text_with_and_without_speculation(sampling, kv):
    common = ["generate", "--dtype", "float64", "-n", "48", "--ignore-eos", *sampling, *kv, PROMPT]
    plain = kvlab(*common)
    spec = kvlab(*common, "--speculative-config", NGRAM)
    assert plain.returncode == 0 == spec.returncode, spec.stderr
    assert spec.stdout == plain.stdout and len(spec.stdout) > len(PROMPT) + 20
    assert "drafted" not in plain.stderr
    stats = spec.stderr.strip().splitlines()[-1]
    assert re.search(r"\| decode 48 tokens, [\d.]+ ms/token .*\| drafted \d+, accepted \d+ \(\d+ %\) \|", stats)
    [(drafted, accepted)] = spec_counts(stats)
    assert drafted > 0 and 0 <= accepted <= drafted
    if sampling == ["--temperature", "0"]:
        assert accepted > 0  # greedy text that quotes its prompt keeps guesses


def test_generate_with_a_draft_model_that_is_the_target_accepts_every_guess(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(DEFAULT_MODEL_DIR, draft)
    common = ["generate", "-n", "24", "--temperature", "0", "--ignore-eos", "The king"]
    plain = kvlab(*common)
    spec = kvlab(*common, "--speculative-config",
                 json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}))
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    [(drafted, accepted)] = spec_counts(spec.stderr)
    assert accepted == drafted > 0


# --- kvlab chat ----------------------------------------------------------------------------------------------
def test_chat_replies_the_same_with_speculation_and_reuses_the_history():
    lines = "To be, or not to be, that is the question\nWho is there? Who is there? Who is there?\nTo be\n"
    for sampling in (["--temperature", "0"], ["--temperature", "0.8", "--seed", "11"]):
        plain = kvlab("chat", "-n", "40", *sampling, stdin=lines)
        spec = kvlab("chat", "-n", "40", *sampling, "--speculative-config", NGRAM, stdin=lines)
        assert plain.returncode == 0 == spec.returncode, spec.stderr
        assert spec.stdout == plain.stdout and spec.stdout.count("\n") >= 3
        notes = [line for line in spec.stderr.splitlines() if line.startswith("[prompt ")]
        assert len(notes) == 3 and len(spec_counts(spec.stderr)) == 3
        reused = [int(re.match(r"\[prompt \d+ tokens \((\d+) cached\)", note).group(1)) for note in notes]
        assert reused[0] == 0 and reused[1] > 0 and reused[2] > reused[1]  # the history's blocks, from the cache
