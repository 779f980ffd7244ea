"""Tokenizers behind one interface: the byte tokenizer of the tiny model and HF `tokenizer.json` files.

Both offer `encode(text, add_bos=...)`, `decode(ids)`, `bos_token_id`, `eos_token_ids`,
`apply_chat_template(messages, add_generation_prompt=True)` (text, or None without a template) and
`stream_decoder()` for printing text as tokens arrive. Reading a model folder (tokenizer_config.json,
generation_config.json, chat templates) lives in kvlab.hf, which builds an HFTokenizer from the files.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from kvlab import validate
from kvlab.errors import InputError


class ChatRenderer(Protocol):
    """What a tokenizer needs from a chat template (kvlab.chat_template.ChatTemplate provides it)."""

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str: ...


class IncrementalDecoder:
    """Text for a stream of token ids, emitted once it is final.

    Byte-level BPE splits a multi-byte character over several tokens, and SentencePiece decoders change a
    token's text depending on what precedes it, so decoding one token at a time prints garbage. This
    decodes a short window twice (up to the last emitted token, and including the new ones) and emits the
    difference, holding it back while it ends in an incomplete character (U+FFFD) — the method of
    transformers' TextStreamer and vLLM's detokenizer, for any tokenizer with `decode(ids)`.
    `context` ids (the prompt's tail) are decoded but never emitted, so the first word gets its space.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids = [int(i) for i in context][-8:]
        self._prefix = 0               # start of the window that is decoded
        self._read = len(self._ids)    # ids before this have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly "")."""
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):] if len(after) > len(before) else ""


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) plus <bos> 256, <eos> 257, <pad> 258: TinyLlama's vocabulary."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 260
    eos_token_ids = (257,)
    max_token_chars = 1   # one byte per token: a text of N characters is at least N tokens

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(validate.text(text).encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special tokens are dropped and broken UTF-8 is replaced, never raised."""
        ids = validate.token_ids(ids, "ids", self.vocab_size, allow_single=False)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> str | None:
        """The byte model has no chat template: None (callers fall back to plain continuation)."""
        return None

    def stream_decoder(self, context: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self.decode, context)

    def token_text(self, token_id: int) -> str:
        """A printable label for one token, for tables: 'a', '\\n', '<0xE2>', '<eos>'."""
        special = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
        if token_id in special:
            return special[token_id]
        if 32 <= token_id < 127:
            return chr(token_id)
        return repr(chr(token_id))[1:-1] if token_id < 128 else f"<0x{token_id:02X}>"


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with the model folder's special-token settings.

    `add_bos_token` is tokenizer_config.json's flag: True (Llama style) makes `encode(text)` start with
    <bos>; False means never; None (the key is absent) leaves special tokens to tokenizer.json's
    post-processor, as transformers does (Llama 3 adds <|begin_of_text|> there).
    """

    def __init__(self, tokenizer: Any, *, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = (), add_bos_token: bool | None = None,
                 chat_template: ChatRenderer | None = None, pad_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.pad_token_id = pad_token_id
        self._specials: dict[str, int] | None = None   # built on first use (below)
        self._text_twins: tuple[Any, Any] | None = None
        self._max_chars: int | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None, *,
               add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of `text`.

        add_bos=None: the folder's convention (see the class docstring); True: exactly one <bos> first;
        False: no special tokens at all (for text rendered by a chat template, which brings its own).
        `add_special_tokens=False` is accepted as the transformers spelling of add_bos=False.
        """
        validate.text(text)
        if add_special_tokens is not None and add_bos is None:
            add_bos = None if add_special_tokens else False
        if add_bos is None and self.add_bos_token is None:
            return _encode(self.tokenizer, text, True)
        ids = _encode(self.tokenizer, text, False)
        want_bos = self.add_bos_token if add_bos is None else add_bos
        if want_bos:
            if self.bos_token_id is None:
                raise InputError("this tokenizer has no bos token to add")
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = validate.token_ids(ids, "ids", allow_single=False)  # ids past the vocabulary decode to ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **variables: Any) -> str | None:
        """The rendered prompt text, or None when the model ships no chat template."""
        if self.chat_template is None:
            return None
        return self.chat_template.render(messages, add_generation_prompt, **variables)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Render with the chat template and encode without adding special tokens (the template has them).

        The template's own markup is parsed for special tokens; the messages' content is text: a
        special-token string a user typed (`<|im_end|>`) becomes ordinary tokens, so it cannot close a
        turn or forge a system message. Content with no such string encodes exactly as before.
        """
        specials = self.special_token_strings
        masked, marks = _mask_specials(messages, specials,
                                       getattr(self.chat_template, "source", ""))
        text = self.apply_chat_template(masked, add_generation_prompt)
        if text is None:
            raise InputError("this model has no chat template")
        if not marks:
            return self.encode(text, add_bos=False)
        return self.encode_markup_and_text(text, marks)

    @property
    def special_token_strings(self) -> dict[str, int]:
        """The strings of the special added tokens (<|im_start|>, <s>, ...) and their ids."""
        if self._specials is None:
            self._specials = {t.content: int(i) for i, t in self.tokenizer.get_added_tokens_decoder().items()
                              if t.special and t.content}
        return self._specials

    @property
    def text_tokenizers(self) -> tuple[Any, Any]:
        """Twins of the tokenizer that read special-token strings as plain text (`encode_special_tokens`),
        for the stretch at the start of a text and for later ones. Separate objects, because the switch is
        state on the tokenizer and encodes run in threads. Two, because a SentencePiece-style Metaspace
        with prepend_scheme "first" adds its "▁" only at the very start of the text, not after a special
        token: the later-stretch twin never prepends."""
        if self._text_twins is None:
            from tokenizers import Tokenizer

            spec = json.loads(self.tokenizer.to_str())
            first = Tokenizer.from_str(json.dumps(spec))
            _never_prepend(spec.get("pre_tokenizer"))
            later = Tokenizer.from_str(json.dumps(spec))
            for twin in (first, later):
                twin.encode_special_tokens = True
            self._text_twins = (first, later)
        return self._text_twins

    def encode_markup_and_text(self, text: str, marks: Mapping[str, str]) -> list[int]:
        """Encode rendered chat text whose content had special strings masked (`marks`: placeholder ->
        special string): markup specials become their ids; every stretch between them is encoded as text,
        placeholders restored, with special strings split into ordinary tokens. Stretches are encoded one
        by one, as the tokenizer itself splits text at special tokens before its pre-tokenizer runs."""
        specials = self.special_token_strings
        pattern = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        restore = re.compile("|".join(re.escape(m) for m in marks)) if marks else None
        ids: list[int] = []
        first, later = self.text_tokenizers
        for i, part in enumerate(pattern.split(text) if specials else [text]):
            if i % 2:
                ids.append(specials[part])
            elif part:
                if restore is not None:
                    part = restore.sub(lambda hit: marks[hit.group(0)], part)
                ids.extend(_encode(first if i == 0 else later, part, False))
        return ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (the longest vocabulary string): a text of N
        characters is at least N / max_token_chars tokens, a bound checked before tokenizing at all."""
        if self._max_chars is None:
            self._max_chars = max((len(s) for s in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return self._max_chars

    def stream_decoder(self, context: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self.decode, context)

    def token_text(self, token_id: int) -> str:
        """The token's vocabulary string (e.g. 'Ġthe'), for tables."""
        return self.tokenizer.id_to_token(int(token_id)) or f"<{token_id}>"


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode`, through `encode_batch`: the batch call releases the GIL while it works (the plain
    one holds it: a 2 MB text froze a server's other threads for a second)."""
    return list(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def _mask_specials(messages: Sequence[Mapping[str, Any]], specials: Mapping[str, int],
                   template_source: str = "") -> tuple[list[Any], dict[str, str]]:
    """The messages with every special-token string in their text content replaced by a private-use
    placeholder character (one per string), and the placeholders used -> the strings they stand for."""
    if not isinstance(messages, (list, tuple)) or not specials:
        return list(messages) if isinstance(messages, (list, tuple)) else messages, {}
    contents = [m.get("content") for m in messages if isinstance(m, Mapping)]
    texts = [c for c in contents if isinstance(c, str)]
    found = [s for s in sorted(specials, key=len, reverse=True) if any(s in t for t in texts)]
    if not found:
        return list(messages), {}
    seen = "".join(texts) + template_source
    free = (chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in seen)
    marks = {s: next(free) for s in found}
    pattern = re.compile("|".join(re.escape(s) for s in found))
    masked = []
    for m in messages:
        if isinstance(m, Mapping) and isinstance(m.get("content"), str):
            m = {**m, "content": pattern.sub(lambda hit: marks[hit.group(0)], m["content"])}
        masked.append(m)
    return masked, {mark: s for s, mark in marks.items()}


def _never_prepend(pre_tokenizer: Any) -> None:
    """Turn every Metaspace(prepend_scheme="first") in a tokenizer.json pre_tokenizer spec into "never", in
    place."""
    if not isinstance(pre_tokenizer, dict):
        return
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
    for child in pre_tokenizer.get("pretokenizers") or []:
        _never_prepend(child)
