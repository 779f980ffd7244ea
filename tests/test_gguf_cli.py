"""Every command on a GGUF file, as a user runs them (real subprocesses): generate, chat, verify, perplexity,
convert; and the sampling a model's GGUF metadata recommends, used when no sampling flag is given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvlab
from gguf_files import TEXT, same_in_every_layer, small_config, write_gguf

pytest.importorskip("gguf")


def kvlab_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny-q8.gguf"
    # Q8_0 and Q5_1 the same in every layer (Q5_1 q/v beside a Q8_0 k): one variant of the fused decode
    # kernels to compile cold, shared by test_gguf_cli.py and test_verify_default.py
    write_gguf(path, small_config("qwen2", max_position_embeddings=64),
               types=same_in_every_layer(q="Q5_1", k="Q8_0", v="Q5_1", o="Q8_0", gate="Q5_1", up="Q8_0", down="Q5_1"))
    (path.parent / "validation.txt").write_text(TEXT * 3, encoding="utf-8")
    return path


def greedy_text(path: Path, prompt_ids: list[int], n: int) -> str:
    model, tokenizer = kvlab.load(path)
    return tokenizer.decode(kvlab.generate(model, [prompt_ids], n)[0])


def test_generate_greedy_and_default_sampling(model_file):
    out = kvlab_cli("generate", "--model", str(model_file), "Hello, world", "-n", "8", "--temperature", "0",
                    "--ignore-eos")
    assert out.returncode == 0, out.stderr
    _, tokenizer = kvlab.load(model_file)
    assert out.stdout == "Hello, world" + greedy_text(model_file, tokenizer.encode("Hello, world"), 8) + "\n"
    # one stats line, after the note that the file's chat template applies with --chat (issue 18 item 11)
    # (a run that had to compile kernels, e.g. after a kernel edit with this test run alone, also says so)
    note, stats = [line for line in out.stderr.splitlines()
                   if "kernels (first run only" not in line and not line.startswith("kernels compiled in")]
    assert "has a chat template" in note and "sampling: greedy (flag + llama.cpp defaults)" in stats

    verbose = kvlab_cli("generate", "--model", str(model_file), "Hello", "-n", "4", "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    assert ("sampling: temperature=0.8 [llama.cpp defaults], top_k=40 [llama.cpp defaults], top_p=0.95 "
            "[llama.cpp defaults], min_p=0.05 [llama.cpp defaults]") in verbose.stderr
    assert "sampling: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (llama.cpp defaults)" in verbose.stderr


def test_the_files_recommended_sampling_applies_without_flags(tmp_path):
    path = tmp_path / "recommends-greedy.gguf"
    write_gguf(path, small_config("qwen2", max_position_embeddings=64),
               extra=lambda w: (w.add_sampling_temp(0.0), w.add_sampling_top_k(20)))
    out = kvlab_cli("generate", "--model", str(path), "Hello", "-n", "6", "--ignore-eos", "--no-display-prompt")
    assert out.returncode == 0, out.stderr
    _, tokenizer = kvlab.load(path)
    assert out.stdout == greedy_text(path, tokenizer.encode("Hello"), 6) + "\n"
    assert "sampling: greedy (recommends-greedy.gguf general.sampling + neutral)" in out.stderr
    flag = kvlab_cli("generate", "--model", str(path), "Hello", "-n", "3", "--temperature", "0.7", "-v")
    assert "temperature=0.7 [flag], top_k=20 [recommends-greedy.gguf general.sampling], top_p=1 [neutral]" \
        in flag.stderr
    # a generation_config.json beside the file wins over the metadata
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    beside = kvlab_cli("generate", "--model", str(path), "Hello", "-n", "3")
    assert "sampling: temperature 0.6, top_p 0.9 (generation_config.json + neutral)" in beside.stderr
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    bad = kvlab_cli("generate", "--model", str(path), "Hello", "-n", "3")
    assert bad.returncode == 2 and "generation_config.json: top_p 0.0 is out of range" in bad.stderr


def test_chat_verify_and_perplexity(model_file):
    chat = kvlab_cli("chat", "--model", str(model_file), "-n", "5", "--temperature", "0", stdin="Hi there\n")
    assert chat.returncode == 0, chat.stderr
    model, tokenizer = kvlab.load(model_file)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi there"}])
    reply = kvlab.generate(model, [ids], 5, stop_token_ids=tokenizer.eos_token_ids)[0]
    assert chat.stdout == tokenizer.decode(reply) + "\n"

    verify = kvlab_cli("verify", "--model", str(model_file), "--dtype", "float32", "--length", "12")
    assert verify.returncode == 0 and "PASS" in verify.stdout, verify.stdout + verify.stderr

    ppl = kvlab_cli("perplexity", "--model", str(model_file), "--max-tokens", "100")
    assert ppl.returncode == 0, ppl.stderr
    assert "tokens evaluated: 100" in ppl.stdout and "perplexity:" in ppl.stdout


def test_convert_writes_a_folder_kvlab_and_transformers_read(model_file, tmp_path):
    out = tmp_path / "hf"
    done = kvlab_cli("convert", str(model_file), str(out))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                    "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    gguf_model, gguf_tokenizer = kvlab.load(model_file, weights_dtype="float32")  # dequantized, as converted
    hf_model, hf_tokenizer = kvlab.load(out)
    ids = gguf_tokenizer.encode(TEXT)
    assert hf_tokenizer.encode(TEXT) == ids
    assert hf_model.config == gguf_model.config.replace(eos_token_id=hf_model.config.eos_token_id)
    prompt = np.array([ids[:30]])
    assert np.array_equal(hf_model.forward(prompt).logits, gguf_model.forward(prompt).logits)
    messages = [{"role": "user", "content": "Hi"}]
    assert hf_tokenizer.apply_chat_template(messages) == gguf_tokenizer.apply_chat_template(messages)
    assert set(hf_tokenizer.eos_token_ids) == set(gguf_tokenizer.eos_token_ids)

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        logits = theirs(torch.tensor([ids[:30]])).logits[0].numpy()
    assert np.abs(logits - gguf_model.forward(np.array([ids[:30]])).logits[0]).max() <= 1e-4
    assert transformers.AutoTokenizer.from_pretrained(str(out))(TEXT)["input_ids"] == ids

    again = kvlab_cli("convert", str(model_file), str(out))
    assert again.returncode == 2 and "already exists" in again.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(model_file.read_bytes()[:1000])
    failed = kvlab_cli("convert", str(bad), str(tmp_path / "never"))
    assert failed.returncode == 2 and "truncated" in failed.stderr
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never*"))


def test_memory_sizes_a_gguf_models_cache_from_its_metadata(model_file):
    # --dtype float16: llama.cpp's cache type; unasked, kvlab memory headlines what kvlab itself allocates,
    # float32 (issue 18 item 6, tests/test_pool_sizing.py)
    out = kvlab_cli("memory", "--model", str(model_file), "--dtype", "float16", "--tokens", "64", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    config = small_config("qwen2")
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    assert result["dtype"] == "float16" and result["bytes_per_token"] == per_token  # llama.cpp's f16 default
    assert result["total_bytes"] == 64 * per_token
