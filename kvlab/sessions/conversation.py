"""A chat's messages and the token ids they render to, turn after turn.

With a chat template (`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` returns text or
ids) the whole history is rendered and tokenized every turn, as a chat server does; the session then reuses
whatever prefix came out the same. Without one (it returns None, or the tokenizer has no such method) the
conversation is plain continuation: <bos> (if the tokenizer has one) and the turns concatenated. There each
assistant turn is kept as the exact ids that were generated rather than re-encoded from its text, so the
next turn's sequence starts with exactly what the session cached and appending reuses every row.
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
            plain = [{"role": m["role"], "content": m["content"]} for m in self.messages]
            rendered = template(plain, add_generation_prompt=True)
        if isinstance(rendered, str):
            return encode_text(tokenizer, rendered)
        if rendered is not None:
            return [int(t) for t in rendered]
        bos = getattr(tokenizer, "bos_token_id", None)
        ids = [] if bos is None else [int(bos)]
        for message in self.messages:
            ids += message.get("token_ids") or encode_text(tokenizer, message["content"])
        return ids

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
