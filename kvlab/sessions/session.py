"""Session: one conversation, one KV cache that survives across chat turns.

A chat client sends the whole history every turn. A cached K/V row for token i stays valid exactly as long
as tokens 0..i are unchanged, so each turn the session keeps the longest common prefix with what it holds,
crops everything after the first difference and computes only the rest:

* appending reuses every row; editing token k keeps exactly k rows; trimming the front keeps none;
* at least one token is always computed, because the turn's logits come from a forward (nano-vllm #144):
  feeding the identical sequence twice gives reused = n - 1, computed = 1 the second time.

Invariant: the cache holds one row per token in `tokens`, at positions 0..n-1, and `logits` (when not None)
are the model's output at the last of them. Every public call validates before it mutates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from kvlab import validate
from kvlab.cache.contiguous import MIN_CAPACITY
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.memory import MemoryReport
from kvlab.sampling.sampler import Sampler, SamplingParams
from kvlab.errors import CheckpointError, ContextLengthError, InputError
from kvlab.generation.loop import DecodeLoop
from kvlab.model.llama import LlamaModel
from kvlab.prefix.token_prefix import common_prefix_length
from kvlab.sessions.persist import read_session_file, write_session_file


@dataclass(frozen=True)
class Turn:
    """What one `feed` did: `tokens` = reused + computed; `logits` [vocab] at the last position."""

    tokens: int
    reused: int
    computed: int
    payload_bytes: int
    logits: np.ndarray
    seconds: float  # wall time of the forward over the computed tokens (the turn's prefill)


class Session:
    """One conversation (batch 1) and the cache that holds its tokens between turns.

    `extra` is application data saved and restored with the cache (the chat keeps its messages there).
    """

    def __init__(self, model: LlamaModel, kv_dtype: object = None, capacity: int = MIN_CAPACITY) -> None:
        self.model = model
        self.cache: KVCache = model.new_cache(1, kv_dtype, capacity)
        self._tokens: list[int] = []
        self._logits: np.ndarray | None = None
        self.extra: dict[str, Any] = {}

    # --- state ---------------------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The token ids whose rows the cache holds (a copy)."""
        return list(self._tokens)

    @property
    def num_cached_tokens(self) -> int:
        return len(self._tokens)

    @property
    def logits(self) -> np.ndarray | None:
        """Logits [vocab] after the last token; None when unknown (fresh, restored or interrupted)."""
        return None if self._logits is None else self._logits.copy()

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    def memory_report(self) -> MemoryReport:
        return self.cache.memory_report()

    def reset(self) -> None:
        """Forget the conversation (capacity stays allocated for the next one)."""
        self.cache.crop(0)
        self._tokens.clear()
        self._logits = None

    # --- turns ---------------------------------------------------------------------------------------------
    def check_tokens(self, token_ids: Any) -> list[int]:
        """The token ids as a list of ints, or InputError / ContextLengthError; mutates nothing."""
        try:
            array = np.asarray(token_ids)
        except ValueError as exc:
            raise InputError(f"token ids must be a flat sequence of ints ({exc})") from None
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 1:
            raise InputError(f"a session holds one sequence: give 1-D token ids, got shape {array.shape}")
        if array.size == 0:
            raise InputError("the token sequence is empty: a turn needs at least one token")
        tokens = validate.token_ids(array, "token ids", self.model.config.vocab_size, allow_single=False)
        if array.size > self.context_length:
            raise ContextLengthError(f"{array.size} tokens exceed the model's context of "
                                     f"{self.context_length} tokens (max_position_embeddings)")
        return tokens

    def feed(self, token_ids: Any) -> Turn:
        """Bring the session to the full conversation `token_ids`, computing only what is not cached."""
        tokens = self.check_tokens(token_ids)
        self.cache.check_compatible(self.model.cache_spec, 1)  # e.g. set_weights since the last turn
        reused = min(common_prefix_length(self._tokens, tokens), len(tokens) - 1)
        start = time.perf_counter()
        self._extend(reused, tokens[reused:])
        seconds = time.perf_counter() - start
        return Turn(tokens=len(tokens), reused=reused, computed=len(tokens) - reused,
                    payload_bytes=self.cache.memory_report().payload_bytes, logits=self._logits.copy(),
                    seconds=seconds)

    def _extend(self, keep: int, new: list[int]) -> None:
        """Keep the first `keep` rows and compute `new` after them. If the forward is interrupted (Ctrl-C,
        out of memory) the session is left holding the first `keep` tokens: smaller, but consistent."""
        self.cache.crop(keep)
        del self._tokens[keep:]
        self._logits = None
        out = self.model.forward(np.asarray([new], dtype=np.int64), cache=self.cache, logits_to_keep=1)
        self._tokens.extend(new)
        self._logits = out.logits[0, -1]

    # --- generation ----------------------------------------------------------------------------------------
    def stream(self, max_new_tokens: int | None = None, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop_token_ids: Iterable[int] = (), grammar: Any = None) -> Iterator[int]:
        """Yield new token ids, continuing the conversation; sampling arguments as in `stream_generate`.

        Each token is fed back before it is yielded, so at every moment the session (tokens, cache,
        logits) includes everything yielded so far, and the next `feed` of history + reply + new message
        reuses all of it (the last token's forward, which `stream_generate` skips, is paid now rather than
        at the next turn). A stop token ends the stream and is kept, as a chat template would render it.
        `max_new_tokens=None` runs to the end of the context. Arguments are checked here, not at the first
        `next()`.
        """
        if not self._tokens:
            raise InputError("the session is empty: feed a prompt before generating")
        room = self.context_length - len(self._tokens)
        if max_new_tokens is None:
            max_new_tokens = room
        max_new_tokens = validate.int_in_range(max_new_tokens, "max_new_tokens", 0)
        if max_new_tokens > room:
            raise ContextLengthError(f"{len(self._tokens)} cached tokens + {max_new_tokens} new tokens "
                                     f"exceed the model's context of {self.context_length} tokens")
        sampler = Sampler(SamplingParams(temperature, top_k, top_p, min_p, seed, grammar=grammar))
        self.cache.check_compatible(self.model.cache_spec, 1)
        stop = frozenset(validate.token_ids(stop_token_ids, "stop_token_ids", self.model.config.vocab_size))
        return DecodeLoop(self._step, sampler, int(max_new_tokens), stop, room=room, feed_back=True, single=True)

    def _step(self, tokens: np.ndarray | None) -> np.ndarray:
        """The decode loop's step: the logits after the last token (tokens None), or after feeding `tokens`."""
        if tokens is not None:
            self._extend(len(self._tokens), [int(tokens[0, 0])])
        elif self._logits is None:  # restored or interrupted: the last token's logits need a forward
            self._extend(len(self._tokens) - 1, self._tokens[-1:])
        return self._logits[None]

    def generate(self, max_new_tokens: int | None = None, **sampling: Any) -> list[int]:
        """The new token ids as a list; see `stream`."""
        return list(self.stream(max_new_tokens, **sampling))

    # --- persistence ---------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write cache, tokens and `extra` to one checksummed safetensors file, atomically (persist.py).

        `extra` must be a dict that survives a JSON round trip unchanged; anything else is refused before the
        file is touched, so a session that saves can always be loaded.
        """
        write_session_file(path, self.cache, self._tokens, self.extra)

    @classmethod
    def load(cls, path: str | Path, model: LlamaModel, kv_dtype: object = None) -> "Session":
        """A session restored from `path`; its next `feed` reuses the restored rows.

        Refuses (CheckpointError / CacheMismatchError) a file from another model, compute dtype or (when
        `kv_dtype` is given) cache dtype, and any truncated, corrupt or modified file; nothing is loaded then.
        """
        saved = read_session_file(path, model, kv_dtype)
        if saved.cache.positions.tolist() != list(range(len(saved.tokens))):
            raise CheckpointError(f"{path}: positions are not 0..{len(saved.tokens) - 1}; a session cache "
                                  "always starts at position 0")
        session = cls(model, kv_dtype=saved.cache.dtype, capacity=1)
        session.cache, session._tokens, session.extra = saved.cache, list(saved.tokens), dict(saved.extra)
        return session

    def __repr__(self) -> str:
        return (f"Session(tokens={len(self._tokens)}, kv_dtype={self.cache.dtype.name}, "
                f"payload_bytes={self.cache.memory_report().payload_bytes})")
