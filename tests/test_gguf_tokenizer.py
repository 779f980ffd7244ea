"""Tokenizers built from GGUF metadata give the ids transformers' GGUF tokenizer gives, on multilingual text
with emoji and code, for both kinds ("gpt2" byte-level BPE per `tokenizer.ggml.pre`, and "llama"
SentencePiece-style with scores), and carry the file's special ids, add_bos flag and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvlab
from gguf_files import CORPUS, SPECIAL, TEXT, byte_level_vocab, small_config, write_gguf
from kvlab.errors import CheckpointError

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

SAMPLES = [TEXT, " leading space", "  two\n\nnewlines\r\n", "numbers 1234567 and 3.14159", "ÀÉÎõü ßø",
           "🙂 emoji only 👩‍👩‍👧", *CORPUS]
KINDS = {"bpe-llama3": ("gpt2", "llama-bpe"), "bpe-qwen2": ("gpt2", "qwen2"), "bpe-gpt2": ("gpt2", "default"),
         "spm": ("llama", "default")}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, (kind, pre) in KINDS.items():
        path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
        write_gguf(path, small_config("llama", hidden_size=32, intermediate_size=32), tokenizer=kind, pre=pre)
        out[name] = path
    return out


@pytest.mark.parametrize("name", list(KINDS))
def test_ids_match_transformers(files, name):
    path = files[name]
    _, ours = kvlab.load(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in SAMPLES:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)
    assert ours.decode(ours.encode(TEXT, add_bos=False), skip_special_tokens=False) == TEXT


def test_byte_level_specials_stop_ids_and_chat_template(files):
    path = files["bpe-qwen2"]
    _, tokenizer = kvlab.load(path)
    tokens, _ = byte_level_vocab()
    im_end, endoftext = tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")
    assert tokenizer.encode("a<|im_end|>b")[1] == im_end  # matched whole, never split
    assert set(tokenizer.eos_token_ids) == {im_end, endoftext}
    assert tokenizer.add_bos_token is False and tokenizer.pad_token_id == endoftext
    messages = [{"role": "user", "content": "Hi 🙂"}]
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tokenizer.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    opening = tokenizer.encode("<|im_start|>assistant\n", add_bos=False)
    assert opening[0] == tokens.index("<|im_start|>")
    assert tokenizer.encode_chat(messages)[-len(opening):] == opening


def test_sentencepiece_bos_and_byte_fallback(files):
    _, tokenizer = kvlab.load(files["spm"])
    ids = tokenizer.encode("龍 ok")
    assert ids[0] == tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,)
    assert tokenizer.encode("龍 ok", add_bos=False) == ids[1:]
    assert [tokenizer.token_text(i) for i in ids[1:5]] == ["▁", "<0xE9>", "<0xBE>", "<0x8D>"]  # byte fallback
    assert tokenizer.decode(ids) == "龍 ok"


def test_smollm_pre_tokenizer_splits_digits_like_its_tokenizer_json(tmp_path):
    """SmolLM's tokenizer.json: Digits(individual) then GPT-2's byte-level regex; llama.cpp's "smollm" pre."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path / "smollm.gguf"
    write_gguf(path, small_config("llama", hidden_size=32, intermediate_size=32), pre="smollm")
    _, ours = kvlab.load(path)
    tokens, merges = byte_level_vocab()
    reference = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    reference.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    reference.decoder = decoders.ByteLevel()
    reference.add_special_tokens(SPECIAL)
    for text in SAMPLES:
        assert ours.encode(text) == reference.encode(text).ids, text
    assert len(ours.encode("12345")) == 5


def test_unknown_pre_tokenizer_and_tokenizer_model_are_refused(tmp_path):
    path = tmp_path / "pre.gguf"
    write_gguf(path, small_config("llama", hidden_size=32, intermediate_size=32), pre="made-up")
    with pytest.raises(CheckpointError, match=r"pre\.gguf: metadata 'tokenizer.ggml.pre' 'made-up'.*supported"):
        kvlab.load(path)
    path = tmp_path / "model.gguf"
    write_gguf(path, small_config("llama", hidden_size=32, intermediate_size=32),
               extra=lambda w: w.kv_data[0]["tokenizer.ggml.model"].__setattr__("value", "bert"))
    with pytest.raises(CheckpointError, match=r"model\.gguf: metadata 'tokenizer.ggml.model' 'bert'"):
        kvlab.load(path)
