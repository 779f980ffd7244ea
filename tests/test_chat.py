"""`kvlab chat`: piped multi-turn chats reuse the cache, commands work, bad commands do not end the chat."""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvlab import ByteTokenizer, Session, TinyLlama
from kvlab.cli import build_parser
from kvlab.cli.chat import Chat
from kvlab.sessions.conversation import Conversation

STATS = re.compile(r"\[prompt (\d+) tokens \((\d+) cached\) · cache (\d+) tok .+ · "
                   r"prefill [\d.]+ ms · decode .+\]")


def stats(stderr: str) -> list[tuple[int, int, int]]:
    """(reused, computed, cache tokens) of each turn's stats line `[prompt N tokens (M cached) · cache T tok ...`."""
    return [(int(m[2]), int(m[1]) - int(m[2]), int(m[3])) for m in STATS.finditer(stderr)]


def run_chat(lines: list[str], *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvlab.cli", "chat", "--tiny", "-n", "6", "--temperature", "0", *flags]
    return subprocess.run(command, input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=120)


def test_piped_chat_reuses_the_cache_across_turns_and_restores_it(tmp_path: Path) -> None:
    saved = tmp_path / "chat.kvc"
    result = run_chat(["Hello there", "How are you?", "/undo", "What now?", "/edit What then?",
                       f"/save {saved}", "/reset", "Fresh start", f"/load {saved}", "And more",
                       f"/load {tmp_path / 'missing.kvc'}", "/bogus", "/quit", "never read"])
    assert result.returncode == 0, result.stderr
    rows = stats(result.stderr)
    assert len(rows) == 6
    (r1, c1, n1), (r2, c2, n2), (r3, c3, n3), (r4, c4, n4), (r5, c5, n5), (r6, c6, n6) = rows
    # The engine never computes the K/V of a reply's last token (vLLM's rule: nothing reads it until the
    # next turn), so each turn computes its new message plus that one token; every cached row is reused,
    # token by token (kvlab/prefix/prefix_cache.py: whole blocks, then the rows of a cached tail).
    assert (r1, c1) == (0, 1 + len("Hello there"))           # <bos> + bytes
    assert (r2, c2) == (n1, len("How are you?") + 1)         # the whole history was reused
    assert f"[prompt {n1 + len('How are you?') + 1} tokens ({n1} cached) · " in result.stderr  # as said
    assert f"[prompt {c1} tokens (0 cached) · " in result.stderr                                # the first turn
    assert r3 >= n1 and r3 + c3 == n1 + len("What now?") + 1  # after /undo: turn 1's rows, and any shared after
    assert r4 >= n1 + len("What ") and r4 + c4 == n1 + len("What then?") + 1  # /edit: kept "What "
    assert (r5, c5) == (0, 1 + len("Fresh start"))           # /reset
    assert (r6, c6) == (n4, len("And more") + 1)             # /load, then a hit on every restored row
    assert "(dropped: 'How are you?')" in result.stderr
    assert f"(saved {n4} tokens" in result.stderr
    assert f"(loaded {n4} cached tokens and 4 messages" in result.stderr
    assert "no such session file" in result.stderr and "unknown command /bogus" in result.stderr
    assert len(result.stdout.splitlines()) >= 6 - 1  # one reply per turn (replies may contain newlines)

    session = Session.load(saved, TinyLlama(seed=7))
    assert [m["content"] for m in session.extra["messages"]][::2] == ["Hello there", "What then?"]


def test_piped_chat_ends_at_eof_and_validates_flags() -> None:
    result = run_chat(["Hi"])
    assert result.returncode == 0 and len(stats(result.stderr)) == 1
    bad = run_chat(["Hi"], "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr
    bad_dtype = run_chat(["Hi"], "--kv-cache-dtype", "int3")
    assert bad_dtype.returncode == 2 and "dtype" in bad_dtype.stderr


def chat_args(**changes) -> argparse.Namespace:
    args = build_parser().parse_args(["chat", "--tiny", "-n", "5", "--temperature", "0"])
    return argparse.Namespace(**{**vars(args), **changes})


def test_replies_equal_a_fresh_session_on_the_same_history(tmp_path: Path) -> None:
    """Reuse never changes an answer: replaying turn 2 on a cold session gives the same reply."""
    model, tokenizer = TinyLlama(seed=7), ByteTokenizer()
    out, err = io.StringIO(), io.StringIO()
    chat = Chat(model, tokenizer, chat_args(), out, err)
    chat.handle("first message")
    chat.handle("second message")
    history = chat.conversation.messages[:-1]
    cold = Session(model)
    cold.feed(Conversation(list(history)).render(tokenizer))
    assert cold.generate(5, stop_token_ids=[257]) == chat.conversation.messages[-1]["token_ids"]
    chat.handle(f"/save {tmp_path / 'c.kvc'}")  # the engine's rows of the whole history, as computed
    saved = Session.load(tmp_path / "c.kvc", model)
    assert saved.tokens == cold.tokens[:len(saved.tokens)] and len(saved.tokens) == len(chat.history_ids)
    for (k, v), (cold_k, cold_v) in zip(saved.cache, cold.cache):
        n = len(saved.tokens)
        np.testing.assert_allclose(k, cold_k[:, :, :n], rtol=0, atol=1e-10)
        np.testing.assert_allclose(v, cold_v[:, :, :n], rtol=0, atol=1e-10)


def test_a_full_context_drops_the_oldest_exchange() -> None:
    model, tokenizer = TinyLlama(seed=7, max_position_embeddings=64), ByteTokenizer()
    err = io.StringIO()
    chat = Chat(model, tokenizer, chat_args(max_tokens=8), io.StringIO(), err)
    for i in range(6):
        chat.handle(f"message number {i}")
    # each turn adds 24 tokens (bos only once): from the third turn on, the oldest exchange goes each time
    assert err.getvalue().count("dropped the oldest exchange") == 4
    users = [m["content"] for m in chat.conversation.messages if m["role"] == "user"]
    assert users == ["message number 4", "message number 5"]
    rendered = chat.conversation.render(tokenizer)  # the cache holds exactly the history (but the last token)
    assert chat.history_ids == rendered[:-1]
    chat.handle("x" * 100)
    assert "does not fit" in err.getvalue()
    assert chat.conversation.messages[-1]["role"] == "assistant"  # history kept, long message dropped


CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_model_folder(folder: Path, chat_template: str | None, **config) -> TinyLlama:
    """A small HF-style model folder: config.json, model.safetensors, the default model's tokenizer
    (`config`: TinyLlama's keywords, e.g. max_position_embeddings)."""
    import json
    import shutil

    import safetensors.numpy

    from kvlab.model.weights import random_weights

    model = TinyLlama(seed=3, vocab_size=4096, bos_token_id=0, eos_token_id=1, dtype=np.float32, **config)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    weights = random_weights(model.config, 3, np.float32)
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},
                                folder / "model.safetensors")
    shipped = Path(__file__).resolve().parents[1] / "kvlab" / "models" / "shakespeare"
    shutil.copy(shipped / "tokenizer.json", folder / "tokenizer.json")
    tok_config = json.loads((shipped / "tokenizer_config.json").read_text())
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return model


@pytest.mark.parametrize("template", [None, CHATML])
def test_piped_chat_with_a_model_folder(tmp_path: Path, template: str | None) -> None:
    """--model PATH with a BPE tokenizer: plain continuation, or the folder's chat template."""
    import kvlab

    make_model_folder(tmp_path / "m", template)
    command = [sys.executable, "-m", "kvlab.cli", "chat", "--model", str(tmp_path / "m"), "-n", "5",
               "--temperature", "0"]
    result = subprocess.run(command, input="To be, or not to be\nthat is the question\n", capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (r1, c1, n1), (r2, c2, n2) = stats(result.stderr)
    model, tokenizer = kvlab.load(tmp_path / "m")
    assert r1 == 0 and r2 > 0 and n2 >= n1
    if template is None:  # plain continuation appends exactly: every row is reused
        assert r2 == n1 and c1 == 1 + len(tokenizer.encode("To be, or not to be", add_bos=False))
    else:  # the template re-renders the history: reuse runs up to the first re-tokenized difference
        first = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": "To be, or not to be"}]), add_bos=False)
        assert c1 == len(first) and r2 >= len(first)


def test_interactive_chat_on_a_terminal(tmp_path: Path) -> None:
    """On a TTY: a banner, a '> ' prompt with readline, replies and stats; Ctrl-D leaves cleanly."""
    import os
    import pty
    import select

    main, child = pty.openpty()
    history = tmp_path / "history"
    command = [sys.executable, "-m", "kvlab.cli", "chat", "--tiny", "-n", "4", "--temperature", "0",
               "--history", str(history)]
    process = subprocess.Popen(command, stdin=child, stdout=child, stderr=child, close_fds=True)
    os.close(child)
    seen = b""

    def read_until(marker: bytes, timeout: float = 60.0) -> None:
        """Read until `marker` appears in output not read before this call."""
        nonlocal seen
        start = len(seen)
        while marker not in seen[start:]:
            ready, _, _ = select.select([main], [], [], timeout)
            assert ready, f"timed out waiting for {marker!r}; got {seen[-500:]!r}"
            try:
                seen += os.read(main, 4096)
            except OSError:  # the child closed the terminal
                break

    try:
        read_until(b"> ")
        os.write(main, b"hello\r")
        read_until(b"decode")
        if not seen.rstrip().endswith(b">"):
            read_until(b"> ")
        os.write(main, b"\x04")  # Ctrl-D at the next prompt
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(main)
    text = seen.decode("utf-8", "replace")
    assert "kvlab chat" in text and "/help" in text and "prompt 6 tokens (0 cached)" in text
    assert "hello" in history.read_text()


def test_a_sampled_reply_is_kept_as_generated_ids_and_the_next_turn_reuses_all_of_it(tmp_path: Path) -> None:
    """A reply's ids re-encoded from its text need not be the same ids ("t","h","e" -> "the"): the next
    turn must be built on the ids the session cached, so an append-only turn reuses every cached row."""
    import kvlab
    from kvlab.sessions.conversation import Conversation

    make_model_folder(tmp_path / "m", CHATML)
    model, tokenizer = kvlab.load(tmp_path / "m")
    session = kvlab.Session(model)
    conversation = Conversation()
    conversation.add("user", "To be, or not to be")
    prompt = conversation.render(tokenizer)
    reply = [tokenizer.encode(c, add_bos=False)[0] for c in " the"] + [1]  # as a sampler might pick; 1 = </s>
    assert tokenizer.encode(tokenizer.decode(reply), add_bos=False) != reply[:-1]  # text loses the ids
    session.feed(prompt + reply)  # what generation leaves in the session: prompt and every generated id
    conversation.add("assistant", tokenizer.decode(reply), reply)
    conversation.add("user", "that is the question")
    following = conversation.render(tokenizer)
    assert following[:len(prompt) + len(reply)] == prompt + reply
    turn = session.feed(following)
    assert turn.reused == len(prompt) + len(reply) and turn.computed == len(following) - turn.reused
    # and once more: the second reply is spliced after the first
    second = [tokenizer.encode(c, add_bos=False)[0] for c in " is"]
    conversation.add("assistant", tokenizer.decode(second), second)
    conversation.add("user", "whether")
    assert conversation.render(tokenizer)[:len(following) + len(second)] == following + second


def test_a_template_that_rewrites_history_stops_the_splice_at_the_changed_reply(tmp_path: Path) -> None:
    """A template that drops earlier replies: the render is tokenized from text (nothing to splice), so
    reuse stops at the first token that changed, as before."""
    import kvlab
    from kvlab.sessions.conversation import Conversation

    drops_replies = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|{{ m['role'] }}|>{{ m['content'] }}"
                     "</s>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    make_model_folder(tmp_path / "m", drops_replies)
    _, tokenizer = kvlab.load(tmp_path / "m")
    conversation = Conversation()
    conversation.add("user", "To be")
    reply = [tokenizer.encode(c, add_bos=False)[0] for c in " the"]
    conversation.add("assistant", tokenizer.decode(reply), reply)
    conversation.add("user", "or not")
    text = tokenizer.apply_chat_template(conversation.to_json())
    assert conversation.render(tokenizer) == tokenizer.encode(text, add_bos=False)


def test_piped_chat_with_sampling_reuses_everything_the_first_turn_cached(tmp_path: Path) -> None:
    """`kvlab chat` sampling at temperature 1 (replies whose text re-encodes to other ids): turn 2 reuses
    every token turn 1 left cached."""
    make_model_folder(tmp_path / "m", CHATML)
    command = [sys.executable, "-m", "kvlab.cli", "chat", "--model", str(tmp_path / "m"), "-n", "12",
               "--temperature", "1", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", "0"]
    result = subprocess.run(command, input="To be, or not to be\nthat is the question\n", capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (r1, c1, n1), (r2, c2, n2) = stats(result.stderr)
    assert r1 == 0 and r2 == n1 and n2 > n1
