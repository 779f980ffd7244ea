"""`kvlab verify --model` checks what users run (issue 32, item 4): float32 with the weights as stored, as
generate, chat and serve load them; float64 (weights dequantized) is the deeper check asked for with --dtype;
every run says which path it verified. The seeds' tiny model keeps its float64 default."""

from __future__ import annotations

import json

import pytest

from gguf_files import same_in_every_layer, small_config, write_gguf
from kvlab.cli import main

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "tiny-q8.gguf"
    # Q8_0 and Q5_1 the same in every layer (Q5_1 q/v beside a Q8_0 k): one variant of the fused decode
    # kernels to compile cold, shared by test_gguf_cli.py and test_verify_default.py
    write_gguf(path, small_config("llama", max_position_embeddings=64),
               types=same_in_every_layer(q="Q5_1", k="Q8_0", v="Q5_1", o="Q8_0", gate="Q5_1", up="Q8_0", down="Q5_1"))
    return path


def verify_json(capsys, *args: str) -> dict:
    code = main(["verify", "--json", "--length", "8", *args])
    result = json.loads(capsys.readouterr().out)
    assert code == (0 if result["passed"] else 1)
    return result


def test_verify_on_a_model_checks_float32_with_the_weights_as_stored(model_file, capsys):
    result = verify_json(capsys, "-m", str(model_file))
    path = result["path"]
    assert path["dtype"] == "float32" and path["weights_as_run"] is True
    assert {"Q8_0", "Q5_1"} & set(path["weights"])  # the GGUF's blocks, not a dequantized copy
    assert "float32" in result["tolerance_rule"] and result["passed"]
    from kvlab.loader import load

    model, _ = load(str(model_file))  # what generate, chat and serve hold: the same formats
    from kvlab.cli.verify import weight_formats

    assert path["weights"] == weight_formats(model) and path["backend"] == model.backend
    # block types run with int8 activations by default, and verify holds that mode to equality
    assert path["activations"] == model.activations
    if model.activations == "q8":
        assert "int8 activations" in path["summary"]
        errors = {c["name"]: c["max_abs_error"] for c in result["checks"]}
        assert all(errors[name] == 0 for name in ("decode", "chunks", "batch", "fork", "crop", "paged")), errors


def test_verify_float64_is_the_deeper_check_and_says_so(model_file, capsys):
    result = verify_json(capsys, "-m", str(model_file), "--dtype", "float64")
    path = result["path"]
    assert path["dtype"] == "float64" and path["weights"] == ["float64"] and path["weights_as_run"] is False
    assert "float64" in result["tolerance_rule"] and result["passed"]
    assert "converted to float64" in path["summary"]


def test_the_table_names_the_path_it_verified(model_file, capsys):
    assert main(["verify", "-m", str(model_file), "--length", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table wraps long lines
    assert "path verified: float32 compute, weights" in out and "as stored, as generate, chat and serve run" in out


def test_the_seeds_tiny_model_still_verifies_in_float64(capsys):
    result = verify_json(capsys)
    assert result["path"]["dtype"] == "float64" and result["path"]["weights"] == ["float64"]
    assert result["model"].startswith("TinyLlama(seed=7) float64") and result["passed"]
