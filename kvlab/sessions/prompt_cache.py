"""A prompt cache file reused and updated across runs, like llama.cpp's `--prompt-cache FILE`.

Each run restores the session saved in the file (if there is one), feeds its prompt so only the part after
the longest common prefix is computed, generates, and saves prompt + generated tokens back atomically. A
file from another model or dtype, or a damaged one, is refused with an error rather than silently
replaced: delete it (or choose another path) to start over.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from kvlab import validate
from kvlab.model.llama import LlamaModel
from kvlab.sessions.session import Session, Turn


@dataclass(frozen=True)
class PromptCacheRun:
    """One run: the new tokens, the prompt's turn (reused / computed), how many rows were restored, why
    generation stopped ("eos", "max tokens" or "context full") and the session (now saved in the file)."""

    new_tokens: list[int]
    turn: Turn
    restored: int
    stop_reason: str
    session: Session


def open_prompt_cache(path: str | Path, model: LlamaModel, kv_dtype: object = None) -> Session:
    """The session saved at `path`, or a fresh one when no file exists there yet."""
    if Path(path).exists() or Path(path).is_symlink():  # a dangling link or a loop: refused by load
        return Session.load(path, model, kv_dtype)
    return Session(model, kv_dtype)


def generate_with_prompt_cache(model: LlamaModel, prompt_ids: Any, path: str | Path,
                               max_new_tokens: int | None = None, *, kv_dtype: object = None,
                               on_token: Callable[[int], None] | None = None,
                               stop_token_ids: Iterable[int] = (), **sampling: Any) -> PromptCacheRun:
    """Generate from `prompt_ids` reusing the cache in `path`, then write the updated cache back.

    `max_new_tokens` is capped at the room left in the context (None: run to the end of it). `sampling`
    takes `Session.stream`'s other arguments (temperature, top_k, top_p, min_p, seed); `on_token` is
    called with each new token as it is chosen (for streaming output). If generation is interrupted, the
    file is not rewritten.
    """
    validate.optional_int(max_new_tokens, "max_new_tokens", 0)
    stop = validate.token_ids(stop_token_ids, "stop_token_ids", model.config.vocab_size)
    session = open_prompt_cache(path, model, kv_dtype)
    restored = session.num_cached_tokens
    tokens = session.check_tokens(prompt_ids)  # a bad prompt fails before any work
    room = session.context_length - len(tokens)
    limit = room if max_new_tokens is None else min(max_new_tokens, room)
    turn = session.feed(tokens)
    new_tokens = []
    loop = session.stream(limit, stop_token_ids=stop, **sampling)
    for token in loop:
        new_tokens.append(token)
        if on_token is not None:
            on_token(token)
    session.save(path)
    return PromptCacheRun(new_tokens=new_tokens, turn=turn, restored=restored, stop_reason=loop.reason.value,
                          session=session)
