"""The CLI as a user runs it: real subprocesses, exit codes and printed numbers."""

import json
import subprocess
import sys

import numpy as np
import pytest


SCHEDULES = ("decode", "chunks", "batch", "fork", "crop", "paged", "engine", "speculative", "speculative-draft",
             "policy")


def kvlab(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", *args], capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvlab {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_verify_passes_on_the_causal_model():
    out = kvlab("verify", "--json")
    result = json.loads(out.stdout)
    assert result["passed"] is True
    assert {c["name"] for c in result["checks"]} == set(SCHEDULES)
    assert all(c["max_abs_error"] <= 1e-10 for c in result["checks"])


def test_verify_float32_uses_its_own_tolerance():
    result = json.loads(kvlab("verify", "--json", "--dtype", "float32").stdout)
    eps32 = float(np.finfo(np.float32).eps)
    check = result["checks"][0]
    assert result["passed"] and check["tolerance"] == pytest.approx(8 * 2 * eps32 * (check["max_abs_logit"] + 1))
    assert "float32" in result["tolerance_rule"]
    assert max(c["max_abs_error"] for c in result["checks"]) > 1e-10  # float32 rounding is visible


def test_verify_bidirectional_fails_with_a_clear_message():
    out = kvlab("verify", "--bidirectional", check=False)
    assert out.returncode == 1
    verdicts = {row[0]: row[-1] for row in table_rows(out.stdout) if row[0]}
    assert verdicts == {name: "FAIL" for name in SCHEDULES}
    assert "not causal" in out.stdout
    result = json.loads(kvlab("verify", "--bidirectional", "--json", check=False).stdout)
    assert result["passed"] is False
    assert all(not c["passed"] and c["max_abs_error"] > 1e-3 for c in result["checks"])


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the rich tables in `text`, as lists of stripped cells (continuation rows too)."""
    return [[cell.strip() for cell in line.strip().strip("│").split("│")]
            for line in text.splitlines() if line.strip().startswith("│")]


def test_memory_tiny_is_512_bytes_per_token():
    out = json.loads(kvlab("memory", "--json", "--tokens", "6").stdout)
    assert out["bytes_per_token"] == 512 and out["total_bytes"] == 3072


def test_memory_7b_config_in_float16(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "max_position_embeddings": 4096, "torch_dtype": "float16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    # --dtype float16: kvlab itself would cache a model of this config in float32 (issue 18 item 6)
    out = json.loads(kvlab("memory", "--config", str(path), "--dtype", "float16", "--json", "--tokens", "4096",
                           "--batch", "2", "--budget", "8GiB").stdout)
    assert out["bytes_per_token"] == 524_288
    assert out["total_bytes"] == 524_288 * 4096 * 2
    assert out["tokens_in_budget"] == 8 * 1024**3 // (524_288 * 2)
    text = kvlab("memory", "--config", str(tmp_path), "--dtype", "fp8").stdout
    per_dtype = {row[0]: int(row[1].replace(",", "")) for row in table_rows(text)}
    assert per_dtype == {"float64": 2_097_152, "float32": 1_048_576, "float16": 524_288,
                         "bfloat16": 524_288, "fp8": 262_144, "int8": 262_144, "int4": 131_072}
    assert "x 1 B (fp8) = 262,144 bytes" in " ".join(text.split())  # the formula for the chosen dtype


@pytest.mark.parametrize("args,message", [
    (["memory", "--config", "/nonexistent/config.json"], "file not found"),
    (["memory", "--dtype", "float7"], "unknown cache dtype"),
    (["memory", "--budget", "lots"], "byte count"),
])
def test_cli_bad_input_is_a_clear_error(args, message):
    out = kvlab(*args, check=False)
    assert out.returncode != 0
    assert message in out.stderr


def test_demo_prints_the_timing_table_work_and_memory():
    out = kvlab("demo", "The cat sat").stdout
    rows = table_rows(out)
    steps = [r for r in rows if r[0].startswith(("prefill", "process"))]
    # prompt of 11 byte tokens, then 5 single-token steps: the cache holds 0-10, then one more each step
    assert [r[1] for r in steps] == [f"0-{n - 1} ({n})" for n in range(11, 17)]
    assert steps[0][0] == "prefill 'The cat sat'"
    assert [r[0] for r in steps[1:]] == [f"process {r[2]}" for r in steps[:-1]]  # each chosen token is fed
    work = {r[0]: (int(r[1]), int(r[2])) for r in rows if r[0].startswith(("with the", "recomputing"))}
    # rows computed per layer: with the cache 11 + 5 = 16; recomputing the prefix 11 + 12 + ... + 16 = 81
    assert work == {"with the cache": (16, 32), "recomputing the prefix each step": (sum(range(11, 17)),
                                                                                    2 * sum(range(11, 17)))}
    memory = {r[0]: int(r[1].replace(",", "")) for r in rows if r[0] in ("payload", "capacity", "metadata")}
    assert memory["payload"] == 16 * 512 and memory["capacity"] >= memory["payload"]
    assert "verify: PASS" in out


def test_verify_runs_on_the_shipped_model_in_float32_and_float64():
    for dtype in ("float32", "float64"):
        result = json.loads(kvlab("verify", "--model", "default", "--dtype", dtype, "--json").stdout)
        eps = float(np.finfo(dtype).eps)
        check = result["checks"][0]  # the shipped model has 4 layers
        assert result["passed"] and check["tolerance"] == pytest.approx(8 * 4 * eps * (check["max_abs_logit"] + 1))
    out = kvlab("verify", "--model", "default", "--bidirectional", check=False)
    assert out.returncode == 2 and "negative control" in out.stderr
