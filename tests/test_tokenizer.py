"""The tokenizer interface: BOS conventions, eos ids from three files, chat templates, streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.errors import CheckpointError, InputError
from kvlab.hf import load_tokenizer
from kvlab.chat_template import ChatTemplate
from kvlab.tokenizer import ByteTokenizer, IncrementalDecoder

tokenizers = pytest.importorskip("tokenizers")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
LLAMA_STYLE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
               "[{{ m['role'] }}] {{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 😀"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"}]


def write_folder(folder: Path, tokenizer_config: dict, generation_config: dict | None = None,
                 config: dict | None = None, jinja: str | None = None) -> Path:
    """tokenizer.json with specials <s> 0, </s> 1, <|im_start|> 2, <|im_end|> 3, then a byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world, again and again; Héllo 😀 Be brief. Hi."] * 3, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_add_bos_token_true_prepends_bos_once(tmp_path):
    tok = load_tokenizer(write_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    plain = tok.encode("hello world", add_bos=False)
    assert tok.encode("hello world") == [0, *plain]
    assert tok.encode("hello world", add_bos=True) == [0, *plain]
    assert tok.encode("<s>hello world") == [0, *plain]  # a bos already in the text is not doubled
    assert tok.encode("hello world", add_special_tokens=False) == plain  # the transformers spelling
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)


def test_without_add_bos_token_the_post_processor_decides(tmp_path):
    folder = write_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"})
    from tokenizers import Tokenizer, processors
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    raw.save(str(folder / "tokenizer.json"))  # Llama 3 style: the tokenizer itself adds <|begin_of_text|>
    tok = load_tokenizer(folder)
    plain = tok.encode("hello", add_bos=False)
    assert tok.encode("hello") == [0, *plain]
    assert plain[0] != 0


def test_add_bos_token_false(tmp_path):
    tok = load_tokenizer(write_folder(tmp_path, {"eos_token": "<|im_end|>", "add_bos_token": False}))
    assert tok.encode("hello") == tok.encode("hello", add_bos=False)
    assert tok.bos_token_id is None
    with pytest.raises(InputError, match="no bos token"):
        tok.encode("hello", add_bos=True)


def test_eos_ids_from_all_three_files(tmp_path):
    # generation_config.json without eos_token_id, tokenizer_config naming one: that one is used
    tok = load_tokenizer(write_folder(tmp_path / "a", {"eos_token": {"content": "<|im_end|>"}}, {"bos_token_id": 0}))
    assert tok.eos_token_ids == (3,)
    # several in generation_config (chat models), plus config.json's and the named one, deduplicated
    tok = load_tokenizer(write_folder(tmp_path / "b", {"eos_token": "</s>"}, {"eos_token_id": [3, 1]},
                                      {"eos_token_id": 1, "bos_token_id": 0}))
    assert tok.eos_token_ids == (3, 1) and tok.eos_token_id == 3
    assert tok.bos_token_id == 0  # from config.json when tokenizer_config names none


def test_chat_template_renders_like_transformers(tmp_path):
    folder = write_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAMA_STYLE})
    tok = load_tokenizer(folder)
    text = tok.apply_chat_template(MESSAGES)
    assert text == "<s>[user] Héllo 😀[assistant] Hi.</s>[user] Again?[assistant]"
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(0) == 1 and ids[0] == 0  # the template's <s> only: no double BOS
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert text == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == \
        hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)


def test_chat_template_jinja_file_overrides_tokenizer_config(tmp_path):
    folder = write_folder(tmp_path, {"chat_template": LLAMA_STYLE}, jinja=CHATML)
    tok = load_tokenizer(folder)
    assert tok.apply_chat_template(MESSAGES[1:2]) == "<|im_start|>user\nHéllo 😀<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(MESSAGES[1:2])
    assert ids[0] == 2 and ids.count(3) == 1  # special tokens in the text map to their ids


def test_no_template_gives_none(tmp_path):
    tok = load_tokenizer(write_folder(tmp_path, {"eos_token": "</s>"}))
    assert tok.apply_chat_template(MESSAGES) is None
    with pytest.raises(InputError, match="no chat template"):
        tok.encode_chat(MESSAGES)
    assert ByteTokenizer().apply_chat_template(MESSAGES) is None


def test_template_environment_features():
    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}\n"
              "{% endfor %}{{ strftime_now('%Y') | length }}")
    text = ChatTemplate(source).render(MESSAGES)
    lines = text.split("\n")
    assert lines[1] == '{"role": "user", "content": "Héllo 😀"}'  # tojson keeps non-ASCII, no HTML escaping
    assert len(lines) == 3 and lines[2] == "4"
    # trim_blocks / lstrip_blocks: block tags leave no blank lines or indentation behind
    assert ChatTemplate("{% if true %}\n    {% if true %}\nx\n    {% endif %}\n{% endif %}\n").render([]) == "x\n"


def test_template_errors_are_clear():
    refuse = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(InputError, match="first must be user"):
        refuse.render(MESSAGES)
    with pytest.raises(InputError, match="rejected"):  # the sandbox is immutable: no mutating the messages
        ChatTemplate("{{ messages.append(1) }}").render(MESSAGES)
    with pytest.raises(CheckpointError, match="does not compile"):
        ChatTemplate("{% for %}", origin="chat_template.jinja")
    with pytest.raises(InputError, match="messages must be"):
        ChatTemplate("x").render([{"content": "no role"}])


def test_byte_stream_decoder_waits_for_whole_characters():
    tok = ByteTokenizer()
    ids = tok.encode("a😀é")
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    assert pieces == ["a", "", "", "", "😀", "", "é"]
    assert decoder.flush() == ""
    partial = tok.stream_decoder()
    assert [partial.push(i) for i in ids[:3]] == ["a", "", ""]
    assert partial.flush() == "\ufffd"  # an unfinished character at the very end is shown as such


def test_metaspace_stream_decoding_keeps_spaces(tmp_path):
    """SentencePiece-style tokens ('▁word') decode differently at the start of a string: the window keeps them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "▁To", "▁be", "▁or", "▁not", "▁to"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    from kvlab.tokenizer import HFTokenizer
    tok = HFTokenizer(raw)
    ids = tok.encode("To be or not to be")
    assert tok.decode(ids) == "To be or not to be" and 0 not in ids
    decoder = tok.stream_decoder(ids[:2])
    assert "".join(decoder.push(i) for i in ids[2:]) == " or not to be"
    # token-by-token decoding would lose every space
    assert "".join(tok.decode([i]) for i in ids[2:]) == "ornottobe"


def test_incremental_decoder_on_any_decode_function():
    decoder = IncrementalDecoder(lambda ids: "".join(chr(65 + i) for i in ids), context=[0, 1])
    assert decoder.push(2) == "C" and decoder.push(3) == "D"
