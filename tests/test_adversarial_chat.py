"""Chat command sequences: whatever a user types, a failing line changes nothing and the history survives.

Hypothesis draws sequences of good lines (messages, /undo, /reset, /save) and bad ones (an /edit or a
message too long for the context, a line that is not UTF-8, /save into a folder, /load of a missing or
corrupt file, unknown commands). After each bad line the conversation and the files are exactly as before;
no line raises.
"""

from __future__ import annotations

import argparse
import copy
import io
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from adversarial import TALLY, tree_state
from kvlab.cli import build_parser
from kvlab.cli.chat import Chat, input_lines
from kvlab.model.llama import TinyLlama
from kvlab.sessions.conversation import Conversation
from kvlab.sessions.session import Session
from kvlab.tokenizer import ByteTokenizer

MODEL = TinyLlama(seed=7, max_position_embeddings=96)
LONG = "y" * 120  # alone it does not fit a 96-token context


def chat_args(**changes) -> argparse.Namespace:
    args = build_parser().parse_args(["chat", "--tiny", "-n", "4", "--temperature", "0"])
    return argparse.Namespace(**{**vars(args), **changes})


GOOD = ["hello", "how are you", "/undo", "/reset", "/save {dir}/ok.kvs", "/edit better", "/help"]
BAD = [f"/edit {LONG}", LONG, None, "/save {dir}/folder", "/load {dir}/missing.kvs", "/load {dir}/garbage.kvs",
       "/load {dir}/folder", "/load {dir}/loop", "/bogus", "/save", "/load"]


@settings(max_examples=25, deadline=None)
@given(lines=st.lists(st.sampled_from(GOOD + BAD), min_size=1, max_size=8))
def test_bad_lines_change_nothing(lines, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    (folder / "folder").mkdir()
    (folder / "garbage.kvs").write_bytes(os.urandom(100))
    os.symlink(folder / "loop", folder / "loop")
    err = io.StringIO()
    chat = Chat(MODEL, ByteTokenizer(), chat_args(), io.StringIO(), err)
    chat.handle("first message")
    for line in lines:
        line = None if line is None else line.replace("{dir}", str(folder))
        before = (copy.deepcopy(chat.conversation.messages), tree_state(folder))
        reported = len(err.getvalue())
        assert chat.handle(line) is True
        if line is None or line in [b.replace("{dir}", str(folder)) for b in BAD if b is not None]:
            TALLY["tried"] += 1
            assert (chat.conversation.messages, tree_state(folder)) == before, line
            assert len(err.getvalue()) > reported, line  # the user is told
            TALLY["clean"] += 1
    # whatever happened, the next reply is the one a fresh session gives on the same history
    chat.handle("last")
    if chat.conversation.messages[-1]["role"] == "assistant":
        history = Conversation(chat.conversation.messages[:-1]).render(ByteTokenizer())
        cold = Session(MODEL)
        cold.feed(history)
        assert cold.generate(len(chat.conversation.messages[-1]["token_ids"]), stop_token_ids=chat.stop) \
            == chat.conversation.messages[-1]["token_ids"]


def test_failed_edit_keeps_the_exchange_it_would_replace():
    """Before: the old message and its reply were already deleted when the edit was found too long."""
    err = io.StringIO()
    chat = Chat(MODEL, ByteTokenizer(), chat_args(), io.StringIO(), err)
    chat.handle("first")
    chat.handle("second")
    kept = copy.deepcopy(chat.conversation.messages)
    TALLY["tried"] += 1
    chat.handle(f"/edit {LONG}")
    assert "does not fit" in err.getvalue() and chat.conversation.messages == kept
    TALLY["clean"] += 1
    chat.handle("/edit second, shorter")  # a fitting edit still replaces it
    assert chat.conversation.messages[-2]["content"] == "second, shorter"
    assert [m["content"] for m in chat.conversation.messages[:2]] == [m["content"] for m in kept[:2]]


def test_non_utf8_lines_from_a_pipe_do_not_end_the_chat():
    raw = io.BytesIO(b"one\n\xff\xfe\xfd\ntwo\n\xc3\n")
    lines = list(input_lines(io.TextIOWrapper(raw, encoding="utf-8"), None))
    assert lines == ["one", None, "two", None]


def test_saved_chat_loads_back_after_bad_lines(tmp_path: Path):
    err = io.StringIO()
    chat = Chat(MODEL, ByteTokenizer(), chat_args(), io.StringIO(), err)
    for line in ("first", None, f"/edit {LONG}", "second", f"/save {tmp_path / 'c.kvs'}"):
        chat.handle(line)
    other = Chat(MODEL, ByteTokenizer(), chat_args(), io.StringIO(), io.StringIO())
    other.handle(f"/load {tmp_path / 'c.kvs'}")
    assert other.conversation.messages == chat.conversation.messages
    assert other.history_ids == chat.history_ids
