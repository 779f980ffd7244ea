"""Tokenizers: the byte tokenizer of the tiny model (HF tokenizer.json support lives in kvlab.hf)."""

from __future__ import annotations

from typing import Iterable


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) plus <bos> 256, <eos> 257, <pad> 258: TinyLlama's vocabulary."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 260

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special tokens are dropped and broken UTF-8 is replaced, never raised."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """A printable label for one token, for tables: 'a', '\\n', '<0xE2>', '<eos>'."""
        special = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
        if token_id in special:
            return special[token_id]
        if 32 <= token_id < 127:
            return chr(token_id)
        return repr(chr(token_id))[1:-1] if token_id < 128 else f"<0x{token_id:02X}>"
