"""`kvlab generate` as a user runs it: a real subprocess on a real model folder."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvlab
from kvlab.cli.generate import TextStream
from kvlab.generation.generate import stream_generate
from test_hf_loader import CONFIG, TEXT, write_folder


def kvlab_generate(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "generate", *args], capture_output=True,
                          text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvlab generate {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "model"
    write_folder(path)
    return path


def test_greedy_text_on_stdout_and_one_stats_line_on_stderr(folder):
    out = kvlab_generate("--model", str(folder), "Now is the winter", "-n", "12", "--temperature", "0",
                         "--ignore-eos")
    model, tokenizer = kvlab.load(folder)
    prompt = tokenizer.encode("Now is the winter")
    want = tokenizer.decode(kvlab.generate(model, [prompt], 12)[0])
    assert out.stdout == "Now is the winter" + want + "\n"  # the prompt is echoed first, as llama.cpp does
    bare = kvlab_generate("--model", str(folder), "Now is the winter", "-n", "12", "--temperature", "0",
                          "--ignore-eos", "--no-display-prompt")
    assert bare.stdout == want + "\n"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    stats = lines[0]
    assert re.search(rf"prompt {len(prompt)} tokens \(0 cached\) \| prefill [\d.]+ ms \([\d]+ tok/s\) \| decode 12 tokens, "
                     r"[\d.]+ ms/token \([\d.]+ tok/s\) \| cache \d+ tokens, [\d.]+ KiB float32 \| stop: max tokens",
                     stats), stats
    assert f"cache {len(prompt) + 11} tokens" in stats  # the last chosen token is never fed back


STATS_CACHE = re.compile(r"\| cache (\d+) tokens, ([\d.]+) KiB (\w+) \|")


def test_sampling_flags_and_kv_cache_dtype(folder):
    args = ["--model", str(folder), "winter", "-n", "10", "--temperature", "0.9", "--top-p", "0.9",
            "--top-k", "50", "--min-p", "0.01", "--ignore-eos"]
    first = kvlab_generate(*args, "--seed", "3", "--kv-cache-dtype", "bf16")
    model, tokenizer = kvlab.load(folder)
    prompt = tokenizer.encode("winter")
    # the same request through the library: every flag must reach the sampler and the cache
    want = kvlab.generate(model, [prompt], 10, kv_dtype="bfloat16", temperature=0.9, top_p=0.9, top_k=50,
                          min_p=0.01, seed=3)[0].tolist()
    assert first.stdout == "winter" + tokenizer.decode(want) + "\n"
    assert kvlab_generate(*args, "--seed", "3", "--kv-cache-dtype", "bf16").stdout == first.stdout  # seeded
    tokens, kib, dtype = STATS_CACHE.search(first.stderr).groups()
    row_bytes = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * CONFIG.head_dim * 2  # bf16
    assert dtype == "bfloat16" and int(tokens) == len(prompt) + 9
    assert float(kib) == pytest.approx(int(tokens) * row_bytes / 1024, abs=0.01)
    third = kvlab_generate(*args, "--seed", "4")
    assert STATS_CACHE.search(third.stderr).group(3) == "float32" and third.stdout != first.stdout
    f64 = kvlab_generate("--model", str(folder), "winter", "-n", "3", "--dtype", "float64", "--max_tokens=3")
    assert STATS_CACHE.search(f64.stderr).groups()[::2] == (str(len(prompt) + 2), "float64")  # underscores


def test_stops_at_eos(tmp_path):
    # A zero LM head makes every logit 0, so greedy picks id 0; name id 0 the eos token.
    write_folder(tmp_path / "m")
    from kvlab.hf.safetensors import load_file, save_file
    weights = dict(load_file(tmp_path / "m" / "model.safetensors"))
    weights["lm_head.weight"] = np.zeros_like(weights["lm_head.weight"])
    save_file(weights, tmp_path / "m" / "model.safetensors")
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    model, tokenizer = kvlab.load(tmp_path / "m")
    assert 0 in tokenizer.eos_token_ids
    loop = stream_generate(model, [tokenizer.encode("winter")], 20, stop_token_ids=tokenizer.eos_token_ids)
    tokens = [int(step[0]) for step in loop]
    assert tokens == [0] and loop.reason.value == "eos"
    out = kvlab_generate("--model", str(tmp_path / "m"), "winter", "-n", "20", "--temperature", "0")
    assert out.stdout == "winter\n" and "decode 1 tokens" in out.stderr and "stop: eos" in out.stderr
    out = kvlab_generate("--model", str(tmp_path / "m"), "winter", "-n", "5", "--temperature", "0",
                         "--ignore-eos")
    assert "decode 5 tokens" in out.stderr and "stop: max tokens" in out.stderr


def test_streams_whole_characters_as_they_come(folder):
    model, tokenizer = kvlab.load(folder)
    prompt = tokenizer.encode("façade")
    target = tokenizer.encode(" 😀 façade", add_bos=False)  # multi-byte characters over several tokens
    out = io.StringIO()
    stream = TextStream(tokenizer, prompt, out)
    writes = []
    out.write = lambda text: writes.append(text) or len(text)  # record each write
    stream.start()
    for token in target:
        stream.on_token(token)
    stream.finish()
    assert "".join(writes) == " 😀 façade\n"
    assert all("\ufffd" not in w for w in writes)
    cache = model.new_cache()
    model.forward([prompt], cache=cache)
    stats = stream.stats(len(prompt), len(prompt), cache.get_seq_length(), 0, "float32", "max tokens")
    assert stats.new_tokens == len(target) and stats.cache_tokens == len(prompt)


def test_chat_flag_uses_the_template(tmp_path):
    write_folder(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %} Answer:"
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    out = kvlab_generate("--model", str(tmp_path / "m"), "--chat", "winter", "-n", "2", "--ignore-eos")
    model, tokenizer = kvlab.load(tmp_path / "m")
    assert f"prompt {len(tokenizer.encode('<s>winter Answer:', add_bos=False))} tokens" in out.stderr


def test_errors_are_one_clear_line(tmp_path, folder):
    missing = kvlab_generate("--model", str(tmp_path / "nope"), "hi", check=False)
    assert missing.returncode == 2 and "no such model folder" in missing.stderr and not missing.stdout
    long = kvlab_generate("--model", str(folder), TEXT * 20, check=False)
    assert long.returncode == 2
    assert f"but the model's context is {CONFIG.max_position_embeddings} tokens" in long.stderr
    no_template = kvlab_generate("--model", str(folder), "--chat", "hi", check=False)
    assert no_template.returncode == 2 and "no chat template" in no_template.stderr
    zero = kvlab_generate("--model", str(folder), "hi", "-n", "0", check=False)
    assert zero.returncode == 2 and "--max-tokens" in zero.stderr


def test_stdin_prompt_and_context_end(folder):
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli", "generate", "--model", str(folder), "-n", "-1",
                           "--ignore-eos", "--temperature", "0"], input="winter", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "stop: context full" in proc.stderr
    # vLLM's rule: prompt + output <= max_model_len, and the last token's K/V is never computed
    assert f"cache {CONFIG.max_position_embeddings - 1} tokens" in proc.stderr


def test_an_overlong_prompt_is_refused_before_it_is_echoed(folder):
    long = kvlab_generate("--model", str(folder), TEXT * 20, check=False)
    assert long.returncode == 2 and "context" in long.stderr and long.stdout == ""


def test_a_model_with_a_chat_template_run_without_chat_says_so(tmp_path, folder):
    write_folder(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %} Answer:"
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    raw = kvlab_generate("--model", str(tmp_path / "m"), "winter", "-n", "2", "--ignore-eos")
    assert "has a chat template" in raw.stderr and "--chat" in raw.stderr and "chat template" not in raw.stdout
    templated = kvlab_generate("--model", str(tmp_path / "m"), "--chat", "winter", "-n", "2", "--ignore-eos")
    assert "has a chat template" not in templated.stderr
    plain = kvlab_generate("--model", str(folder), "winter", "-n", "2", "--ignore-eos")  # no template: no note
    assert "has a chat template" not in plain.stderr


def test_seed_minus_one_says_which_seed_it_drew_and_that_seed_repeats_the_run(folder):
    args = ("--model", str(folder), "winter", "-n", "8", "--ignore-eos", "--temperature", "1.5", "--top-k", "0",
            "--top-p", "1", "--min-p", "0")
    drawn = kvlab_generate(*args, "--seed", "-1", "-v")
    seeds = re.findall(r"seed (\d+) \(drawn for --seed -1; --seed \1 repeats this run\)", drawn.stderr)
    assert len(seeds) == 2  # once with -v before generating, once on the stats line
    assert seeds[0] == seeds[1]
    again = kvlab_generate(*args, "--seed", seeds[0])
    assert again.stdout == drawn.stdout and "drawn" not in again.stderr


def test_the_stats_line_reports_a_compile_only_when_numba_compiled():
    from kvlab.cli.generate import GenerationStats
    from kvlab.kernels import AVAILABLE, CompileCounter

    stats = GenerationStats(prompt_tokens=3, computed_prompt_tokens=3, prefill_seconds=0.1, new_tokens=2,
                            decode_seconds=0.1, cache_tokens=5, cache_bytes=10, cache_dtype="float32",
                            stop_reason="max tokens", compile_seconds=0.0)
    assert "kernels compiled" not in stats.line()
    stats.compile_seconds = 0.3  # a short compile is still a compile
    assert "kernels compiled 0.3 s" in stats.line()
    if not AVAILABLE:
        pytest.skip("numba is not installed")
    import numba

    model = kvlab.TinyLlama(seed=1, dtype=np.float32)
    model.warm_up()
    with CompileCounter() as warm:  # every kernel is compiled in this process already: nothing compiles
        model.warm_up()
    assert warm.count == 0
    with CompileCounter() as fresh:
        numba.njit(lambda x: x + 1)(1)
    assert fresh.count >= 1
