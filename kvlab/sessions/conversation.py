"""A chat's messages and the token ids they render to, turn after turn.

Each assistant turn keeps the exact ids that were generated (as llama.cpp's slots and Ollama's context do):
a sampled reply re-encoded from its text need not give the same ids (SmolLM2: [3706, 99, 306, 301] ->
[3706, 8045, 301]), and every id that differs from what the session cached ends its reuse.

With a chat template (`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` returns text)
the whole history is rendered every turn, as a chat server does, and the generated ids are spliced into
it: the text before each reply is tokenized as the prompt of that turn was (so it gives the same ids), the
reply's ids are taken as generated, and tokenizing resumes after the text they stand for. That holds for
templates whose rendered history is a prefix of the next render (ChatML, Llama 3, Mistral); where a
template rewrites history (strips earlier replies, trims them), the splice stops at the first reply whose
text is not found where expected and the rest is tokenized from text, so reuse stops at the first changed
token. A template that returns ids is used as it is. Without a template (it returns None, or the tokenizer
has no such method) the conversation is plain continuation: <bos> (if the tokenizer has one) and the turns
concatenated, replies again as their generated ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (a template brings its own; <bos> is added separately).

    Accepts the HF convention (`add_special_tokens=False`), kvlab.ByteTokenizer's `encode(text)`, and
    encoders that return an object with `.ids` (tokenizers.Encoding).
    """
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return [int(i) for i in getattr(ids, "ids", ids)]


def decode_text(tokenizer: Any, ids: list[int]) -> str:
    """The text `ids` stand for, special tokens included where the tokenizer can say so."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode(ids)


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages as a template sees them: role and content (generated ids are ours, not the template's)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass
class Conversation:
    """Messages as {"role", "content"} dicts; assistant messages may carry their generated "token_ids"."""

    messages: list[dict[str, Any]] = field(default_factory=list)

    # --- editing -------------------------------------------------------------------------------------------
    def add(self, role: str, content: str, token_ids: list[int] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        message: dict[str, Any] = {"role": role, "content": str(content)}
        if token_ids is not None:
            message["token_ids"] = [int(t) for t in token_ids]
        self.messages.append(message)

    def last_user_index(self) -> int | None:
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i]["role"] == "user":
                return i
        return None

    def edit_last_user(self, content: str) -> bool:
        """Replace the last user message and drop what came after it (its reply). False if there is none."""
        i = self.last_user_index()
        if i is None:
            return False
        del self.messages[i:]
        self.add("user", content)
        return True

    def undo(self) -> list[dict[str, Any]]:
        """Drop the last exchange (the last user message and everything after it); return what was dropped."""
        i = self.last_user_index()
        if i is None:
            return []
        dropped = self.messages[i:]
        del self.messages[i:]
        return dropped

    def drop_oldest_exchange(self) -> bool:
        """Drop the first user message and its reply (system messages stay). False if nothing to drop."""
        first = next((i for i, m in enumerate(self.messages) if m["role"] == "user"), None)
        if first is None or first == self.last_user_index():
            return False
        end = next(i for i in range(first + 1, len(self.messages)) if self.messages[i]["role"] == "user")
        del self.messages[first:end]
        return True

    # --- rendering -----------------------------------------------------------------------------------------
    def render(self, tokenizer: Any) -> list[int]:
        """The token ids of the whole conversation, ready for the assistant's next turn."""
        template = getattr(tokenizer, "apply_chat_template", None)
        rendered = None
        if template is not None:
            rendered = template(_plain(self.messages), add_generation_prompt=True)
        if isinstance(rendered, str):
            return self._splice(tokenizer, template, rendered)
        if rendered is not None:
            return [int(t) for t in rendered]
        bos = getattr(tokenizer, "bos_token_id", None)
        ids = [] if bos is None else [int(bos)]
        for message in self.messages:
            ids += message.get("token_ids") or encode_text(tokenizer, message["content"])
        return ids

    def _splice(self, tokenizer: Any, template: Any, full: str) -> list[int]:
        """`full` (the rendered conversation) tokenized, with each reply's generated ids in place of its text.

        For the reply at message j: `before` is the render of messages[:j] with the generation prompt (the
        text of that turn's prompt) and `through` the render of messages[:j+1] without it. The splice holds
        while `full` starts with `through`, `through` with `before`, and the reply's part of `through` with
        text its ids decode to (special tokens included: a kept stop token such as <|im_end|> is text the
        template writes too), and that text begins with the message's content (the ids stand for it)."""
        ids: list[int] = []
        consumed = 0  # characters of `full` accounted for by `ids`
        for j, message in enumerate(self.messages):
            generated = message.get("token_ids")
            if message["role"] != "assistant" or not generated:
                continue
            before = template(_plain(self.messages[:j]), add_generation_prompt=True)
            through = template(_plain(self.messages[:j + 1]), add_generation_prompt=False)
            said = decode_text(tokenizer, generated)
            if not (isinstance(before, str) and isinstance(through, str) and len(before) >= consumed
                    and said.startswith(message["content"]) and full.startswith(through)
                    and through.startswith(before) and through.startswith(said, len(before))):
                break  # the template rewrote this reply (or what precedes it): tokenize the rest as text
            ids += encode_text(tokenizer, before[consumed:]) + [int(t) for t in generated]
            consumed = len(before) + len(said)
        return ids + encode_text(tokenizer, full[consumed:])

    # --- saving --------------------------------------------------------------------------------------------
    def to_json(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.messages]

    @classmethod
    def from_json(cls, data: Any) -> "Conversation":
        """Rebuild from `to_json` output (e.g. a session file's extra data); ValueError if malformed."""
        if not isinstance(data, list):
            raise ValueError("messages must be a list")
        conversation = cls()
        for m in data:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"malformed message {m!r}")
            ids = m.get("token_ids")
            if ids is not None and not (isinstance(ids, list) and all(type(t) is int for t in ids)):
                raise ValueError(f"malformed token ids in message {m!r}")
            conversation.add(m.get("role"), m["content"], ids)
        return conversation
