"""`kvlab quantize`: GGUF files of quantized weights, from an HF folder or a GGUF, that kvlab and
transformers' GGUF loader read back with the weights kvlab meant to write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvlab
from kvlab import LlamaModel
from kvlab.errors import InputError
from kvlab.loader import read_float_weights
from kvlab.model.quantized import dequantized, quantize_weights

pytest.importorskip("gguf")
SHIPPED = Path(kvlab.__file__).parent / "models" / "shakespeare"
TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


def quantize(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli", "quantize", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "shakespeare-q8_0.gguf"
    done = quantize(str(SHIPPED), str(out), "--type", "q8_0")
    assert done.returncode == 0, done.stderr
    assert "matrices Q8_0" in done.stderr
    return out


def test_hf_folder_to_q8_0_loads_with_exactly_the_quantized_weights(q8_file):
    model, tokenizer = kvlab.load(q8_file, weights_dtype="float32")  # dequantized: the same float values
    reference, ref_tokenizer = kvlab.load()
    ids = ref_tokenizer.encode(TEXT)
    assert tokenizer.encode(TEXT) == ids and tokenizer.eos_token_ids == ref_tokenizer.eos_token_ids
    config, weights = read_float_weights(None)
    expected = LlamaModel(config, dequantized(quantize_weights(weights, "q8_0")), dtype=np.float32,
                          backend=model.backend)
    got = model.forward(np.array([ids])).logits
    assert np.array_equal(got, expected.forward(np.array([ids])).logits)  # the same weights, bit for bit
    assert np.abs(got - reference.forward(np.array([ids])).logits).max() > 0  # and really quantized


def test_transformers_reads_kvlabs_file_with_the_same_logits(q8_file):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, tokenizer = kvlab.load(q8_file, activations="float32")  # exact products of the stored blocks
    ids = tokenizer.encode(TEXT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(q8_file.parent), gguf_file=q8_file.name,
                                                           dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(model.forward(np.array([ids])).logits[0] - theirs).max() <= 1e-4


def test_gguf_requantized_equals_quantizing_its_dequantized_weights(q8_file, tmp_path):
    out = tmp_path / "q4_1.gguf"
    done = quantize(str(q8_file), str(out), "--type", "Q4_1")
    assert done.returncode == 0, done.stderr
    config, q8_weights = read_float_weights(q8_file)
    _, q4_weights = read_float_weights(out)
    want = dequantized(quantize_weights(q8_weights, "q4_1"))
    assert q4_weights.keys() == want.keys()
    for name in want:
        assert np.array_equal(q4_weights[name], want[name]), name
    _, tokenizer = kvlab.load(out)
    assert tokenizer.encode(TEXT) == kvlab.load(q8_file)[1].encode(TEXT)  # metadata copied as it was


def test_bad_requests_are_refused_and_leave_nothing(tmp_path):
    out = tmp_path / "x.gguf"
    cases = [((str(SHIPPED), str(out), "--type", "q3_x"), "unknown weight quantization 'q3_x'"),
             ((str(SHIPPED), str(tmp_path / "x.bin"), "--type", "q8_0"), "must be a .gguf file"),
             ((str(tmp_path / "nope"), str(out), "--type", "q8_0"), "no such model folder or file")]
    for args, message in cases:
        done = quantize(*args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    assert list(tmp_path.iterdir()) == []


def test_tokenizers_without_a_llama_cpp_name_are_refused():
    from kvlab.gguf.writer import bpe_pre_name

    assert bpe_pre_name({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel", "use_regex": True,
                                                                      "add_prefix_space": False}}) == "gpt2"
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                    {"type": "ByteLevel"}]}
    assert bpe_pre_name({"model": {"type": "BPE"}, "pre_tokenizer": digits}) == "smollm"
    with pytest.raises(InputError, match="only byte-level BPE tokenizers"):
        bpe_pre_name({"model": {"type": "Unigram"}, "pre_tokenizer": {"type": "Metaspace"}})
    with pytest.raises(InputError, match="has no llama.cpp name"):
        bpe_pre_name({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}})
