"""The wire format: OpenAI request bodies as validated pydantic models, and OpenAI-shaped errors.

Field names and meanings follow the OpenAI API, plus vLLM's sampling extensions (`top_k`, `min_p`,
`ignore_eos`, `stop_token_ids`, `cache_salt`), so clients written for either work unchanged. Structured output
comes in each server's spelling: OpenAI's `response_format`, vLLM's `structured_outputs` and llama.cpp's
`grammar` / `json_schema`; `grammar_spec()` turns whichever was sent into one GrammarSpec. Anything a
client can send is checked here or by the engine's own validation before it reaches the engine loop; the
engine never sees a value of the wrong type.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from kvlab.errors import InputError
from kvlab.sampling.grammar import GrammarSpec
from kvlab.sampling.sampler import SamplingParams

MAX_LOGPROBS = 20          # OpenAI's bound for logprobs / top_logprobs
MAX_N = 64
MAX_STOP_STRINGS = 16      # OpenAI allows 4; vLLM is unbounded; a bound keeps matching cheap
MAX_STOP_TOKEN_IDS = 256   # a bound keeps per-request work small (an unbounded list is a denial of service)
MAX_PROMPTS = 64           # prompts in one /v1/completions batch
GREEDY_BELOW = 1e-5        # vLLM's epsilon: smaller temperatures are greedy (no division by ~0)


class APIError(Exception):
    """An error sent to the client as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do: clients send vendor fields we do not know.
    # Strict: an int is not a bool and "2" is not a number (a float field still takes a JSON int).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`: {name, schema, strict, description}."""

    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar (GBNF/Lark), or
    json_object."""

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _spec(make: Any, param: str, *args: Any) -> GrammarSpec:
    try:
        return make(*args)
    except InputError as exc:
        raise bad_request(str(exc), param, "invalid_grammar") from None


class _SamplingBody(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    # OpenAI's default is 1.0, not greedy; NaN and inf are refused as "not a finite number"
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[StrictInt] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)
    user: str | None = None
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    response_format: ResponseFormat | None = None          # OpenAI
    structured_outputs: StructuredOutputs | None = None    # vLLM
    grammar: str | None = None                             # llama.cpp: GBNF
    json_schema: dict[str, Any] | None = None              # llama.cpp: a JSON schema

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def check_supported(self) -> None:
        """Refuse what kvlab does not implement rather than silently ignoring it."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise bad_request(f"{name} is not supported by kvlab (only 0.0)", name)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def grammar_spec(self) -> GrammarSpec | None:
        """What the answer must match, from whichever field was sent (only one may be); None for free text.
        A bad value is a 400 naming the field; compiling it (kvlab.serve.app) checks it against the grammar
        engine."""
        field = self.grammar_field()
        if field is None:
            return None
        if field == "grammar":
            return _spec(GrammarSpec.grammar, "grammar", self.grammar)
        if field == "json_schema":
            return _spec(GrammarSpec.json_schema, "json_schema", self.json_schema)
        if field == "response_format":
            return self._response_format_spec()
        return self._structured_outputs_spec()

    def grammar_field(self) -> str | None:
        """The one field that structures the output, or None (a 400 when several do)."""
        given = [name for name in ("response_format", "structured_outputs", "grammar", "json_schema")
                 if getattr(self, name) is not None and not (name == "response_format"
                                                              and self.response_format.type == "text")]
        if len(given) > 1:
            raise bad_request(f"give one way of structuring the output, not {' and '.join(given)}", given[1])
        return given[0] if given else None

    def _response_format_spec(self) -> GrammarSpec:
        fmt = self.response_format
        if fmt.type == "json_object":
            return GrammarSpec.json_object()
        if fmt.type != "json_schema":
            raise bad_request(f"response_format.type {fmt.type!r} is not supported: use 'text', 'json_object' "
                              "or 'json_schema'", "response_format", "invalid_response_format")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema",
                              "response_format", "invalid_response_format")
        return _spec(GrammarSpec.json_schema, "response_format", fmt.json_schema.schema_)

    def _structured_outputs_spec(self) -> GrammarSpec:
        so = self.structured_outputs
        given = [name for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                          ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise bad_request("structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                              + (f" (got {', '.join(given)})" if given else ""), "structured_outputs")
        make = {"json": lambda: GrammarSpec.json_schema(so.json_), "regex": lambda: GrammarSpec.regex(so.regex),
                "choice": lambda: GrammarSpec.choice(so.choice), "grammar": lambda: GrammarSpec.grammar(so.grammar),
                "json_object": GrammarSpec.json_object}[given[0]]
        return _spec(make, "structured_outputs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, grammar: Any = None) -> SamplingParams:
        """`grammar`: the CompiledGrammar of `grammar_spec()`, or None."""
        temperature = self.temperature if self.temperature >= GREEDY_BELOW else 0.0
        return SamplingParams(n=self.n, max_tokens=max_tokens, temperature=temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                              stop_token_ids=tuple(self.stop_token_ids), stop=tuple(self.stop),
                              ignore_eos=self.ignore_eos, logprobs=logprobs, grammar=grammar)


Prompt = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingBody):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)      # OpenAI's and vLLM's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported by kvlab", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported by kvlab", "suffix")
        if self.best_of not in (None, self.n):
            raise bad_request("best_of other than n is not supported by kvlab", "best_of")

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch: one string or token list per prompt."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]               # one prompt as token ids
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt",
                              "too_many_prompts")
        return [p if isinstance(p, str) else list(p) for p in prompt]


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")   # name, tool_call_id, ... go to the template as they are
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: content as one string."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(part.text for part in content)
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        return {**extra, "role": self.role, "content": content if content is not None else ""}


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)        # None: to EOS or the end of the context
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]



class ResetRequest(_Body):
    """POST /reset_prefix_cache, /pause and /resume take an empty JSON object: a body is required so that no
    cross-site form can post it (see kvlab.serve.guard)."""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, the body of every 4xx and 5xx."""

    error: ErrorDetail
