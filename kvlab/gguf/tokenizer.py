"""An HFTokenizer from a GGUF file's `tokenizer.ggml.*` metadata, built as a `tokenizers` object.

A GGUF file has no tokenizer.json: it stores the vocabulary (`tokens`, `scores`, `token_type`), the BPE
`merges` and the special ids, and names the algorithm in `tokenizer.ggml.model`:

- "llama": SentencePiece-style BPE over "▁"-spaced text with byte fallback (<0x0A> tokens). Files
  without merges get them from the scores: a piece that is the concatenation of two vocabulary pieces
  is a merge, ranked by its score, as SentencePiece merges the best-scoring pair first.
- "gpt2": byte-level BPE with explicit merges; the text is first split by the regex of
  `tokenizer.ggml.pre` (llama.cpp's name for the model family's pre-tokenizer).

The construction follows llama.cpp and transformers' GGUF integration, so ids agree with both. Tokens the
file marks as control (type 3) are matched whole as special tokens, user-defined ones (type 4) as plain
added tokens. Stop ids: eos, plus end-of-turn/end-of-message ids and control tokens that llama.cpp also
treats as end of generation (e.g. <|im_end|>, <|eot_id|>).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.errors import CheckpointError
from kvlab.gguf.reader import GGUFFile
from kvlab.chat_template import ChatTemplate
from kvlab.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4
SPIECE_SPACE = "\u2581"

# Split regexes by tokenizer.ggml.pre (Llama 3's tiktoken pattern and Qwen2's, which splits single digits)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT,
              "smaug-bpe": LLAMA3_SPLIT, "falcon3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT,
              "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "megrez": QWEN2_SPLIT}
GPT2_PRE = ("default", "gpt-2", "gpt2")  # GPT-2's own regex (ByteLevel's built-in)
DIGIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r")  # single digits, then GPT-2's regex
SUPPORTED_PRE = sorted(PRE_SPLITS) + list(GPT2_PRE) + list(DIGIT_PRE)
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>",
                     "<|eom_id|>", "<EOT>", "</s>")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the spelling of every byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def merges_from_scores(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two vocabulary pieces,
    best score first (then longer left part), in vocabulary order within one piece."""
    vocab = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, (float(s) for s in scores)))
    found = []
    for piece, score in score_of.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found += [(score, left, right) for left, right in splits]
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _array(gguf: GGUFFile, key: str, count: int) -> Any:
    value = gguf.get(key)
    if value is not None and len(value) != count:
        raise CheckpointError(f"{gguf.path}: metadata {key!r} has {len(value)} entries but there are {count} tokens")
    return value


def _spm_tokenizer(gguf: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = gguf.get("tokenizer.ggml.merges")
    if merges is None:
        scores = _array(gguf, "tokenizer.ggml.scores", len(tokens))
        if scores is None:
            raise CheckpointError(f"{gguf.path}: a 'llama' tokenizer needs 'tokenizer.ggml.scores' or "
                                  "'tokenizer.ggml.merges'")
        pairs = merges_from_scores(tokens, scores)
    else:
        pairs = _merge_pairs(gguf, merges)
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = gguf.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                     unk_token=tokens[unk] if _valid_id(unk, tokens) else None))
    prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, split=False,
                                                       prepend_scheme="first" if prefix else "never")
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _bpe_tokenizer(gguf: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE:
        raise CheckpointError(f"{gguf.path}: metadata 'tokenizer.ggml.pre' {pre!r} is not a supported "
                              f"pre-tokenizer; supported: {', '.join(SUPPORTED_PRE)}")
    merges = gguf.get("tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError(f"{gguf.path}: a 'gpt2' tokenizer needs 'tokenizer.ggml.merges'")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (an added token stored as its text) is looked up by its bytes.
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(gguf, merges), continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    if pre in PRE_SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in DIGIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merge_pairs(gguf: GGUFFile, merges: Any) -> list[tuple[str, str]]:
    pairs = []
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ") if isinstance(merge, str) else ("", "", "")
        if not space or not left or not right:
            raise CheckpointError(f"{gguf.path}: metadata 'tokenizer.ggml.merges'[{i}] is {merge!r}, "
                                  "expected 'left right'")
        pairs.append((left, right))
    return pairs


def _valid_id(value: Any, tokens: list[str]) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(tokens)


def _special_id(gguf: GGUFFile, key: str, tokens: list[str]) -> int | None:
    value = gguf.get(key)
    if value is None:
        return None
    if not _valid_id(value, tokens):
        raise CheckpointError(f"{gguf.path}: metadata {key!r} = {value!r} is not a token id "
                              f"(the vocabulary has {len(tokens)} tokens)")
    return int(value)


def tokenizer_from_metadata(gguf: GGUFFile) -> HFTokenizer:
    """The file's tokenizer with its special ids, add_bos flag and chat template."""
    from tokenizers import AddedToken

    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{gguf.path}: metadata 'tokenizer.ggml.tokens' is missing or empty")
    if kind == "llama":
        tokenizer = _spm_tokenizer(gguf, tokens)
    elif kind == "gpt2":
        tokenizer = _bpe_tokenizer(gguf, tokens)
    else:
        raise CheckpointError(f"{gguf.path}: metadata 'tokenizer.ggml.model' {kind!r} is not supported; "
                              "supported: llama (SentencePiece), gpt2 (byte-level BPE)")
    types = _array(gguf, "tokenizer.ggml.token_type", len(tokens))
    types = [] if types is None else [int(t) for t in types]
    ids = {name: _special_id(gguf, f"tokenizer.ggml.{key}", tokens) for name, key in
           (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"), ("eot", "eot_token_id"), ("eom", "eom_token_id"))}
    alphabet = set(byte_alphabet().values()) if kind == "gpt2" else None
    control = [i for i, t in enumerate(types) if t == CONTROL and (alphabet is None or set(tokens[i]) <= alphabet)]
    special = sorted(set(control) | {ids[n] for n in ("bos", "eos", "unk", "pad") if ids[n] is not None})
    tokenizer.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in special])
    user = [AddedToken(tokens[i], normalized=False, special=False) for i, t in enumerate(types) if t == USER_DEFINED]
    if user:
        tokenizer.add_tokens(user)

    eos = [ids[n] for n in ("eos", "eot", "eom") if ids[n] is not None]
    eos += [i for i in control if tokens[i] in END_OF_GENERATION]
    add_bos = gguf.get("tokenizer.ggml.add_bos_token", kind == "llama")
    template = gguf.get("tokenizer.chat_template")
    chat = None
    if template is not None:
        if not isinstance(template, str):
            raise CheckpointError(f"{gguf.path}: metadata 'tokenizer.chat_template' must be a string")
        names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unk", "pad_token": "pad"}
        chat = ChatTemplate(template, {k: tokens[ids[v]] if ids[v] is not None else None for k, v in names.items()},
                            f"{gguf.path}: tokenizer.chat_template")
    return HFTokenizer(tokenizer, bos_token_id=ids["bos"], eos_token_ids=eos, add_bos_token=bool(add_bos),
                       chat_template=chat, pad_token_id=ids["pad"])
