"""A draft model for speculative decoding: a smaller (or quantized) model that guesses greedily ahead.

Its guesses are only guesses: the target verifies each one (kvlab/engine/speculative.py), so the draft may be
any model kvlab loads, in its own weights format and dtype, with its own contiguous KVCache per sequence. It
must speak the target's tokenizer: the same token strings at the same ids and the same special ids (not the
same embedding rows: Qwen2.5 0.5B and 7B pad their embeddings differently and share a tokenizer).

Per sequence the draft keeps a cache of the ids it has seen; before guessing it feeds what the target
emitted since (one chunk), and after verification it crops back to the longest prefix the sequence kept.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from kvlab.errors import ConfigError
from kvlab.prefix.token_prefix import common_prefix_length


def same_tokenizer(target: Any, draft: Any) -> str | None:
    """None if the two tokenizers map the same strings to the same ids with the same special ids; else
    what differs, in words."""
    if target is None or draft is None:
        return "a draft model needs both tokenizers to compare (give the engine the target's tokenizer)"
    a, b = target.tokenizer.get_vocab(with_added_tokens=True), draft.tokenizer.get_vocab(with_added_tokens=True)
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:3]
        return f"their vocabularies differ ({len(a)} vs {len(b)} tokens; e.g. {differ})"
    for name in ("bos_token_id", "eos_token_ids", "pad_token_id"):
        if getattr(target, name) != getattr(draft, name):
            return f"their {name} differ ({getattr(target, name)} vs {getattr(draft, name)})"
    return None


class DraftProposer:
    """Greedy guesses from a draft model, one contiguous cache per sequence (dropped with the sequence)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> (cache, ids fed)

    def propose(self, seq: Any, count: int) -> list[int]:
        cache, fed = self._state.get(seq, (None, []))
        ids = seq.token_ids
        common = common_prefix_length(fed, ids)
        if common == len(ids):  # all fed already (the last step did not verify: not scheduled, guesses
            common -= 1         # trimmed by the budget): feed the last token again for its logits
        if cache is None or common == 0:
            cache, fed, common = None, [], 0
        elif common < len(fed):
            cache.crop(common)
            del fed[common:]
        guesses: list[int] = []
        pending = ids[common:]
        for _ in range(count):
            out = self.model.forward(np.asarray([pending], dtype=np.int64), cache=cache, use_cache=True)
            cache = out.cache
            fed.extend(pending)
            token = int(np.argmax(out.logits[0, -1]))
            guesses.append(token)
            pending = [token]
        self._state[seq] = (cache, fed)
        return guesses

    def rollback(self, seq: Any) -> None:
        """Crop the draft's cache to the ids the sequence kept (rejected guesses leave it)."""
        cache, fed = self._state.get(seq, (None, []))
        if cache is None:
            return
        common = common_prefix_length(fed, seq.token_ids)
        if common == 0:
            del self._state[seq]
        elif common < len(fed):
            cache.crop(common)
            del fed[common:]


def load_draft(path: str, target: Any, tokenizer: Any) -> DraftProposer:
    """Load the draft at `path` and check it can guess for `target` (ConfigError naming the problem)."""
    from kvlab.loader import load  # the engine layer may import the loader; kept lazy: loading is rare

    try:
        draft, draft_tokenizer = load(path, dtype=target.dtype)
    except Exception as exc:  # any load failure is a bad speculative_config.model
        raise ConfigError(f"speculative_config.model {path}: {exc}") from None
    problem = same_tokenizer(tokenizer, draft_tokenizer)
    if problem is not None:
        raise ConfigError(f"speculative_config.model {path} has another tokenizer than the target: {problem}")
    if draft.config.vocab_size > target.config.vocab_size:
        raise ConfigError(f"speculative_config.model {path} guesses from {draft.config.vocab_size} token ids, "
                          f"the target knows {target.config.vocab_size}")
    return DraftProposer(draft)
