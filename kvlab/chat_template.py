"""Chat templates: the Jinja source a model ships, rendered the way transformers renders it.

Why replicate transformers' environment exactly: templates on the Hub are written against it. They rely on
`trim_blocks`/`lstrip_blocks` whitespace handling, `{% break %}`/`{% continue %}` (loopcontrols), a
`tojson` filter that keeps non-ASCII text as is, and the `raise_exception` and `strftime_now` globals. The
environment is sandboxed and immutable: a template comes from a downloaded file and must not be able to
reach Python objects or mutate the messages.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvlab.errors import CheckpointError, InputError


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: unlike Jinja's built-in one it does not HTML-escape and keeps non-ASCII."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates refer to (bos_token, ...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None,
                 origin: str = "chat template") -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        try:
            self._template = make_environment().from_string(source)
        except TemplateError as exc:
            raise CheckpointError(f"{origin}: the chat template does not compile ({exc})") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        Raises InputError when the messages are malformed or the template itself refuses them
        (templates call raise_exception, e.g. "roles must alternate user/assistant").
        """
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
            raise InputError("messages must be a list of {'role': str, 'content': ...} dicts")
        context = {**self.special_tokens, **variables, "messages": [dict(m) for m in messages],
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except TemplateError as exc:
            raise InputError(f"{self.origin}: the chat template rejected the messages: {exc}") from None
