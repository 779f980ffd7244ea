"""The CLI as a user runs it: real subprocesses, exit codes and printed numbers."""

import json
import subprocess
import sys

import pytest


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
    assert {c["name"] for c in result["checks"]} == {"decode", "chunks", "batch", "fork", "crop", "paged",
                                                     "engine"}
    assert all(c["max_abs_error"] <= 1e-10 for c in result["checks"])


def test_verify_float32_uses_its_own_tolerance():
    result = json.loads(kvlab("verify", "--json", "--dtype", "float32").stdout)
    assert result["passed"] and result["checks"][0]["tolerance"] == 1e-4
    assert max(c["max_abs_error"] for c in result["checks"]) > 1e-10  # float32 rounding is visible


def test_verify_bidirectional_fails_with_a_clear_message():
    out = kvlab("verify", "--bidirectional", check=False)
    assert out.returncode == 1
    assert "FAIL" in out.stdout and "not causal" in out.stdout


def test_memory_tiny_is_512_bytes_per_token():
    out = json.loads(kvlab("memory", "--json", "--tokens", "6").stdout)
    assert out["bytes_per_token"] == 512 and out["total_bytes"] == 3072


def test_memory_7b_config_in_float16(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "max_position_embeddings": 4096, "torch_dtype": "float16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = json.loads(kvlab("memory", "--config", str(path), "--json", "--tokens", "4096", "--batch", "2",
                           "--budget", "8GiB").stdout)
    assert out["bytes_per_token"] == 524_288
    assert out["total_bytes"] == 524_288 * 4096 * 2
    assert out["tokens_in_budget"] == 8 * 1024**3 // (524_288 * 2)
    text = kvlab("memory", "--config", str(tmp_path), "--dtype", "fp8").stdout
    assert "262,144" in text


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
    assert "prefill 'The cat sat'" in out and "0-10 (11)" in out and "0-15 (16)" in out
    assert "with the cache" in out and "16" in out and "81" in out
    assert "8,192" in out and "PASS" in out


def test_verify_runs_on_the_shipped_model_in_float32_and_float64():
    for dtype, tolerance in (("float32", 1e-4), ("float64", 1e-10)):
        result = json.loads(kvlab("verify", "--model", "default", "--dtype", dtype, "--json").stdout)
        assert result["passed"] and result["checks"][0]["tolerance"] == tolerance
    out = kvlab("verify", "--model", "default", "--bidirectional", check=False)
    assert out.returncode == 2 and "negative control" in out.stderr
