"""The shipped Shakespeare model: loads by default, matches transformers, reproduces its card's perplexity."""

import re
import subprocess
import sys

import numpy as np
import pytest

import kvlab
from kvlab.perplexity import perplexity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer = kvlab.load()
    reference = transformers.AutoModelForCausalLM.from_pretrained(kvlab.hf.DEFAULT_MODEL_DIR,
                                                                  dtype=torch.float32).eval()
    return model, tokenizer, reference


def test_default_model_matches_transformers_logits_and_greedy_tokens(shipped):
    model, tokenizer, reference = shipped
    ids = tokenizer.encode("ROMEO:\nWhat light through yonder window breaks?")
    assert ids[0] == tokenizer.bos_token_id == 0
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.numpy()
    assert np.abs(model.forward(np.array([ids])).logits - want).max() < 1e-4
    prompt = tokenizer.encode("ROMEO:")
    with torch.no_grad():
        hf = reference.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                                pad_token_id=1)[0, len(prompt):].tolist()
    ours = kvlab.generate(model, np.array([prompt]), max_new_tokens=len(hf),
                          stop_token_ids=model.config.eos_token_ids)[0].tolist()
    assert ours == hf


def test_perplexity_on_validation_text_equals_transformers(shipped):
    model, tokenizer, reference = shipped
    text = (kvlab.hf.DEFAULT_MODEL_DIR / "validation.txt").read_text(encoding="utf-8")
    stream = tokenizer.encode(text, add_bos=False)[:2048]
    ours = perplexity(model, stream, tokenizer.bos_token_id)
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(stream), 256):
            chunk = stream[start:start + 256]
            logits = reference(torch.tensor([[0] + chunk[:-1]])).logits[0].double()
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(chunk), reduction="sum").item()
    assert ours.tokens == 2048
    assert abs(ours.mean_nll - total / 2048) < 1e-5


def test_model_card_perplexity_is_what_kvlab_perplexity_prints():
    card = (kvlab.hf.DEFAULT_MODEL_DIR / "README.md").read_text()
    claimed = float(re.search(r"perplexity ([0-9.]+) per token", card).group(1))
    out = subprocess.run([sys.executable, "-m", "kvlab", "perplexity"], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    measured = float(re.search(r"perplexity: ([0-9.]+)", out).group(1))
    assert "tokens evaluated: 79,085" in out
    assert abs(measured - claimed) < 0.01


def test_generate_cli_writes_shakespeare_shaped_text():
    out = subprocess.run([sys.executable, "-m", "kvlab", "generate", "ROMEO:", "-n", "120",
                          "--temperature", "0"], capture_output=True, text=True, check=True, timeout=300)
    speakers = re.findall(r"^([A-Z][A-Z ]+):$", out.stdout, re.M)
    assert speakers, out.stdout  # speaker headings such as JULIET: on their own line
    assert "decode" in out.stderr and "tok/s" in out.stderr
