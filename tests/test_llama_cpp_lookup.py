"""bench/llama_cpp_lookup.py without llama.cpp: parsing a recorded llama-lookup run (its stderr as this build
prints it, log prefixes included) and the command line the bench runs it with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import llama_cpp_lookup  # noqa: E402

PROMPT = "<|im_start|>user\nRepeat: To be.<|im_end|>\n<|im_start|>assistant\n"
GENERATED = "To be, or not to be.\n\nThe original text"
# stderr as llama-lookup printed it (SmolLM2-135M-Instruct Q4_1, --spec-draft-n-max 5); stdout shortened
STDOUT = "\n\n" + PROMPT + GENERATED + "\n\n" + "\n\n"
STDERR = """0.00.422.564 I cmn          init: llama threadpool init, n_threads = 2
0.04.249.082 I encoded   55 tokens in    0.525 seconds, speed:  165.563 t/s
0.04.249.101 I decoded   32 tokens in    2.890 seconds, speed:   11.072 t/s
0.04.249.114 I 
0.04.249.127 I n_draft      = 5
0.04.249.140 I n_predict    = 32
0.04.249.153 I n_drafted    = 15
0.04.249.167 I t_draft_flat = 0.07 ms
0.04.249.181 I t_draft      = 0.37 ms, 24.93 us per token, 40106.95 tokens per second
0.04.249.194 I n_accept     = 6
0.04.249.207 I accept       = 40.000%
0.04.249.220 I 
target:

0.04.249.238 I common_perf_print:    sampling time =      10.86 ms
"""


def test_parse_reads_counts_timings_and_the_generated_text():
    run = llama_cpp_lookup.parse_lookup(STDOUT, STDERR, PROMPT)
    assert (run.prompt_tokens, run.tokens, run.draft_max, run.drafted, run.accepted) == (55, 32, 5, 15, 6)
    assert (run.prefill_s, run.decode_s) == (0.525, 2.890)
    assert run.decode_tokens_per_s == pytest.approx(11.072, abs=1e-3)   # llama.cpp's own "speed"
    assert run.tokens_per_s == pytest.approx(32 / (0.525 + 2.890))
    assert run.acceptance == pytest.approx(0.4)
    assert run.text == GENERATED


def test_plain_run_has_no_acceptance_and_a_prompt_not_echoed_gives_no_text():
    stderr = (STDERR.replace("n_draft      = 5", "n_draft      = 0").replace("n_drafted    = 15", "n_drafted    = 0")
              .replace("n_accept     = 6", "n_accept     = 0"))
    run = llama_cpp_lookup.parse_lookup(STDOUT, stderr, "a prompt it did not echo")
    assert (run.draft_max, run.drafted, run.accepted, run.acceptance, run.text) == (0, 0, 0, None, "")


@pytest.mark.parametrize("old, new, match", [
    ("decoded   32 tokens", "generated 32 tokens", "lacks decoded"),
    ("n_accept     = 6", "n_accept     = ?", "lacks n_accept"),
    ("n_predict    = 32", "n_predict    = 33", "n_predict 33 but decoded 32"),
])
def test_missing_or_inconsistent_lines_are_refused(old, new, match):
    assert old in STDERR
    with pytest.raises(ValueError, match=match):
        llama_cpp_lookup.parse_lookup(STDOUT, STDERR.replace(old, new), PROMPT)


def test_command_is_greedy_raw_and_asks_one_token_less(tmp_path):
    binary = tmp_path / llama_cpp_lookup.BINARY
    command = llama_cpp_lookup.lookup_command(binary, tmp_path / "m.gguf", PROMPT, tokens=96, threads=2,
                                              draft_max=5, n_ctx=512)

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("-p") == PROMPT           # one argument, trailing newline kept
    assert {"--no-escape", "--ignore-eos"} <= set(command)
    assert [value(f) for f in ("-n", "--spec-draft-n-max", "--temp", "-t", "-tb", "-c")] == \
        ["95", "5", "0", "2", "2", "512"]


def test_find_binary_needs_an_executable_in_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    assert llama_cpp_lookup.find_binary(None) is None
    assert llama_cpp_lookup.find_binary(str(tmp_path)) is None
    binary = tmp_path / llama_cpp_lookup.BINARY
    binary.write_text("#!/bin/sh\n")
    assert llama_cpp_lookup.find_binary(str(tmp_path)) is None      # not executable
    binary.chmod(0o755)
    assert llama_cpp_lookup.find_binary(str(tmp_path)) == binary
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    assert llama_cpp_lookup.find_binary(None) == binary
