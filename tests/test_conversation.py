"""Conversation: the messages of a chat and the token ids they render to (moved from test_chat, extended).

Every expected id list is written out by hand from the byte tokenizer (ids 0-255 are bytes, 256 <bos>).
"""

from __future__ import annotations

import pytest

from kvlab import ByteTokenizer
from kvlab.sessions.conversation import ROLES, Conversation, encode_text


class TemplateTokenizer(ByteTokenizer):
    """A byte tokenizer with a ChatML-like template, to check the template path."""

    def apply_chat_template(self, messages, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_conversation_rendering() -> None:
    plain = Conversation()
    plain.add("user", "ab")
    plain.add("assistant", "cd", [99, 257])
    assert plain.render(ByteTokenizer()) == [256, 97, 98, 99, 257]
    assert plain.render(TemplateTokenizer()) == list(b"<user>ab</><assistant>cd</><assistant>")

    class NoTemplate(ByteTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=False):
            return None

    assert plain.render(NoTemplate()) == [256, 97, 98, 99, 257]


def test_conversation_editing() -> None:
    c = Conversation()
    assert c.undo() == [] and not c.edit_last_user("x") and not c.drop_oldest_exchange()
    c.add("system", "s")
    for i in range(3):
        c.add("user", f"u{i}")
        c.add("assistant", f"a{i}", [i])
    assert c.edit_last_user("u2'") and [m["content"] for m in c.messages][-2:] == ["a1", "u2'"]
    assert c.drop_oldest_exchange() and [m["content"] for m in c.messages] == ["s", "u1", "a1", "u2'"]
    assert [m["content"] for m in c.undo()] == ["u2'"]
    assert Conversation.from_json(c.to_json()) == c
    with pytest.raises(ValueError):
        Conversation.from_json([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError):
        Conversation.from_json([{"role": "user", "content": "x", "token_ids": ["a"]}])


class HFStyle:
    """An HF-like tokenizer: encode(text, add_special_tokens=...), no bos, no chat template attribute."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # conversation text never gets special tokens added
        return [ord(c) + 1000 for c in text]


class Encoding:
    def __init__(self, ids):
        self.ids = ids


class EncodingStyle:
    """A tokenizers.Tokenizer-like encoder: encode(text) returns an object with .ids (no keyword)."""

    bos_token_id = 7

    def encode(self, text):
        return Encoding([ord(c) for c in text])


def test_encode_text_accepts_the_three_conventions() -> None:
    assert encode_text(HFStyle(), "ab") == [1097, 1098]
    assert encode_text(ByteTokenizer(), "ab") == [97, 98]  # no <bos>: the byte tokenizer's default
    ids = encode_text(EncodingStyle(), "ab")
    assert ids == [97, 98] and all(type(i) is int for i in ids)


def test_render_without_a_template_uses_bos_if_any_and_generated_ids() -> None:
    c = Conversation()
    c.add("system", "s")
    c.add("user", "hi")
    c.add("assistant", "yo", [5, 6, 7])  # generated ids are kept, not re-encoded from "yo"
    assert c.render(HFStyle()) == [1115, 1104, 1105, 5, 6, 7]  # no bos_token_id attribute: none added
    assert c.render(EncodingStyle()) == [7, 115, 104, 105, 5, 6, 7]


def test_render_with_a_template_returning_ids() -> None:
    class IdsTemplate(ByteTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=False):
            assert add_generation_prompt is True
            assert all(set(m) == {"role", "content"} for m in messages)  # token_ids are not passed on
            return [len(messages), 40.0, 41]

    c = Conversation()
    c.add("user", "x")
    c.add("assistant", "y", [1])
    ids = c.render(IdsTemplate())
    assert ids == [2, 40, 41] and all(type(i) is int for i in ids)


def test_add_validates_the_role_and_copies_ids() -> None:
    assert ROLES == ("system", "user", "assistant")
    c = Conversation()
    with pytest.raises(ValueError, match="role must be one of"):
        c.add("robot", "x")
    assert c.messages == []
    ids = [1, 2]
    c.add("assistant", 42, ids)
    ids.append(3)
    assert c.messages == [{"role": "assistant", "content": "42", "token_ids": [1, 2]}]
    c.add("user", "u")
    assert "token_ids" not in c.messages[-1]


def test_last_user_index_and_edits_with_trailing_messages() -> None:
    c = Conversation()
    c.add("system", "s")
    assert c.last_user_index() is None
    c.add("user", "u0")
    c.add("assistant", "a0")
    c.add("user", "u1")
    c.add("assistant", "a1")
    c.add("assistant", "a1b")
    assert c.last_user_index() == 3
    assert c.edit_last_user("u1'")
    assert [m["content"] for m in c.messages] == ["s", "u0", "a0", "u1'"]
    dropped = c.undo()
    assert [m["content"] for m in dropped] == ["u1'"]
    assert [m["content"] for m in c.messages] == ["s", "u0", "a0"]


def test_drop_oldest_exchange_drops_up_to_the_next_user_message() -> None:
    c = Conversation()
    c.add("system", "s")
    c.add("user", "u0")
    c.add("assistant", "a0")
    c.add("assistant", "a0b")
    c.add("user", "u1")
    c.add("assistant", "a1")
    c.add("user", "u2")
    assert c.drop_oldest_exchange()
    assert [m["content"] for m in c.messages] == ["s", "u1", "a1", "u2"]
    assert c.drop_oldest_exchange()
    assert [m["content"] for m in c.messages] == ["s", "u2"]
    assert not c.drop_oldest_exchange()  # the last user message is never dropped
    assert [m["content"] for m in c.messages] == ["s", "u2"]


def test_json_round_trip_copies_and_validation() -> None:
    c = Conversation()
    c.add("user", "u")
    c.add("assistant", "a", [4, 5])
    data = c.to_json()
    data[0]["content"] = "changed"
    assert c.messages[0]["content"] == "u"  # to_json returns copies
    back = Conversation.from_json(c.to_json())
    assert back == c and back.messages is not c.messages
    for bad, message in [
            ({"role": "user", "content": "x"}, "^messages must be a list$"),
            ([["user", "x"]], r"malformed message \['user', 'x'\]"),
            ([{"role": "user", "content": 3}], "malformed message"),
            ([{"role": "user"}], "malformed message"),
            ([{"role": "robot", "content": "x"}], "role must be one of"),
            ([{"role": "user", "content": "x", "token_ids": [True]}], "malformed token ids in message"),
            ([{"role": "user", "content": "x", "token_ids": (1, 2)}], "malformed token ids in message")]:
        with pytest.raises(ValueError, match=message):
            Conversation.from_json(bad)


def test_drop_oldest_exchange_with_consecutive_user_messages() -> None:
    c = Conversation()
    for role, text in [("user", "u0"), ("user", "u1"), ("assistant", "a1"), ("user", "u2")]:
        c.add(role, text)
    assert c.drop_oldest_exchange()  # the oldest exchange is u0 alone: it got no reply
    assert [m["content"] for m in c.messages] == ["u1", "a1", "u2"]
