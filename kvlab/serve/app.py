"""The OpenAI-compatible HTTP API on one `kvlab.Engine`: routes, error handlers, the explorer page.

`create_app(engine, tokenizer, ...)` returns a FastAPI app whose lifespan starts and stops the engine loop
thread (kvlab.serve.loop). Handlers validate on the asyncio side, tokenize and render chat templates in a
worker thread (so one huge prompt never stalls other clients), hand requests to the loop, and render its
outputs; they never touch the engine directly. Before any handler, kvlab.serve.guard checks the Host, the
body's type and its size.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlab import validate
from kvlab.errors import ContextLengthError, InputError, KVLabError
from kvlab.prefix.block_hash import root_key
from kvlab.sampling.grammar import CompiledGrammar, compile_grammar, grammar_vocab
from kvlab.serve.guard import RequestGuard
from kvlab.serve.limits import DEFAULT_MAX_REQUEST_BYTES
from kvlab.serve.http import AbortingStreamingResponse, APIKeyMiddleware, unless_disconnected
from kvlab.serve.loop import EngineFailure, EngineLoop, RequestGroup
from kvlab.serve.metrics import CONTENT_TYPE, ServerMetrics
from kvlab.serve.openapi import ERROR_RESPONSES, HEALTH_RESPONSES, METRICS_RESPONSES, install_openapi
from kvlab.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  ResetRequest, TokenizeRequest, bad_request)
from kvlab.serve.responses import SSE_DONE, StreamRenderer, chat_body, completion_body, sse

STATIC_DIR = Path(__file__).resolve().parent / "static"

PRECHECK_SLACK = 4   # normalizers may shrink text a little: refuse only what is hopeless by this margin
NO_CHAT_TEMPLATE = ("this model has no chat template, so chat messages cannot be formatted; use "
                    "/v1/completions with a prompt, or start the server with --chat-template FILE")


class ServerState:
    """What the handlers share: the loop, the tokenizer and the names the model is served under."""

    def __init__(self, engine: Any, tokenizer: Any, model_names: list[str], model_root: str,
                 max_waiting: int, hide_cache_text: bool = False) -> None:
        self.engine_loop = EngineLoop(engine, ServerMetrics(model_names[0]), max_waiting)
        self.engine_loop.metrics.bind(lambda: self.engine_loop.stats)
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.model_root = model_root
        self.max_model_len = int(engine.max_model_len)
        self.engine_policy = getattr(engine, "kv_policy", None)  # --kv-policy: prompts may outgrow the context
        self.vocab_size = int(engine.model.config.vocab_size)
        self.eos_token_ids = tuple(sorted(engine.eos_token_ids))
        self.created = int(time.time())
        self.hide_cache_text = hide_cache_text
        self.max_token_chars = max(int(getattr(tokenizer, "max_token_chars", 1) or 1), 1)
        self._root = lambda salt: root_key(engine.model.fingerprint, engine.model.dtype, engine.kv_cache_dtype,
                                           salt).hex()
        self.unsalted_root = self._root(None)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        raise APIError(404, f"The model `{requested}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")

    def check_ids(self, ids: list[int], param: str) -> None:
        outside = validate.out_of_vocab(ids, self.vocab_size)
        if outside is not None:
            raise bad_request(f"token id {outside[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param)

    def precheck(self, num_chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context, before tokenizing it: a text of N characters is at
        least N / max_token_chars tokens."""
        least = num_chars // (self.max_token_chars * PRECHECK_SLACK)
        if least > self.max_model_len and self.engine_policy is None:  # a kv policy keeps its budget
            raise bad_request(f"the {param} has {num_chars} characters, at least {least} tokens: more than "
                              f"max_model_len {self.max_model_len}", param, "context_length_exceeded")

    async def encode_prompts(self, prompts: list[Any]) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized in a worker thread, special tokens parsed)."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self.precheck(len(prompt), "prompt")
        ids = await asyncio.to_thread(lambda: [self.tokenizer.encode(p) if isinstance(p, str) else p
                                               for p in prompts])
        for one in ids:
            self.check_ids(one, "prompt")
        return ids

    async def render_chat(self, messages: list[Any], add_generation_prompt: bool) -> list[int]:
        """The chat prompt's ids: the template rendered and encoded in a worker thread, the messages'
        content as text (a special-token string in it never becomes a control token)."""
        rendered = [m.for_template() for m in messages]
        self.precheck(sum(len(m["content"]) for m in rendered), "messages")
        return await asyncio.to_thread(self._render_chat, rendered, add_generation_prompt)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(NO_CHAT_TEMPLATE, "messages", "chat_template_missing")
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)

    async def compile_grammar(self, body: Any) -> CompiledGrammar | None:
        """The request's grammar compiled for this model's vocabulary (None for free text), in a worker thread:
        a large schema never stalls other clients; equal grammars come from the cache. A 400 naming the
        field when the grammar is invalid or past the grammar engine's limits."""
        spec = body.grammar_spec()
        if spec is None:
            return None
        try:
            return await asyncio.to_thread(
                lambda: compile_grammar(spec, grammar_vocab(self.tokenizer, self.vocab_size, self.eos_token_ids)))
        except InputError as exc:
            raise bad_request(str(exc), body.grammar_field(), "invalid_grammar") from None

    def visible_state(self, snapshot: dict[str, Any], cache_salt: str | None) -> dict[str, Any]:
        """The cache state a caller may see: a block's text, tokens and hashes only when it belongs to no
        tenant (unless --hide-cache-text) or to the caller's own `cache_salt`; other blocks still count."""
        readable = set() if self.hide_cache_text else {self.unsalted_root}
        if cache_salt and not self.hide_cache_text:
            readable.add(self._root(cache_salt))
        for block in snapshot.get("blocks", []):
            if block.pop("root_key", None) in readable:
                block["text"] = self.tokenizer.decode(block.get("token_ids", []))
                block["hidden"] = False
            else:
                block.update(text=None, token_ids=[], hash=None, parent=None, hidden=True)
        for request in snapshot.get("requests", []):
            request.pop("root_key", None)
        return snapshot


def _hold_back(stops: list[str]) -> int:
    return max((len(s) for s in stops), default=1) - 1


def create_app(engine: Any, tokenizer: Any, *, model_names: list[str], model_root: str = "",
               api_key: str | None = None, max_waiting: int = 256,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, allowed_hosts: tuple[str, ...] = (),
               hide_cache_text: bool = False, enable_pause: bool = False) -> FastAPI:
    """The app; its lifespan runs the engine loop. Shutdown draining is the runner's: call
    `app.state.kvlab.engine_loop.begin_shutdown(grace_s)` when a stop signal arrives."""
    state = ServerState(engine, tokenizer, model_names, model_root, max_waiting, hide_cache_text)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine_loop.start()
        try:
            yield
        finally:
            state.engine_loop.stop()

    app = FastAPI(title="kvlab", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.kvlab = state
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestGuard, max_request_bytes=max_request_bytes, allowed_hosts=allowed_hosts)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _install_error_handlers(app)
    loop = state.engine_loop

    # --- plain endpoints ------------------------------------------------------------------------------
    @app.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health() -> Response:
        return Response(status_code=200 if loop.alive else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def explorer() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "kvlab",
             "root": state.model_root, "parent": None, "max_model_len": state.max_model_len}
            for name in state.model_names]}

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = await state.render_chat(body.messages, body.add_generation_prompt)
        else:
            add_bos = None if body.add_special_tokens else False
            ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt, add_bos)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.model_name(body.model)
        state.check_ids(body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}

    @app.post("/reset_prefix_cache", responses=ERROR_RESPONSES)
    async def reset_prefix_cache(body: ResetRequest) -> dict[str, Any]:
        return {"reset": bool(await loop.call(lambda engine: engine.reset_prefix_cache()))}

    if enable_pause:   # off by default: one caller could stall every tenant (vLLM keeps it to dev mode)
        @app.post("/pause", responses=ERROR_RESPONSES)
        async def pause(body: ResetRequest) -> dict[str, Any]:
            """Stop stepping the engine: requests in flight keep their blocks and wait; new ones queue."""
            loop.set_paused(True)
            return {"paused": True}

        @app.post("/resume", responses=ERROR_RESPONSES)
        async def resume(body: ResetRequest) -> dict[str, Any]:
            loop.set_paused(False)
            return {"paused": False}

        @app.get("/is_paused")
        async def is_paused() -> dict[str, Any]:
            return {"is_paused": loop.paused}

    @app.get("/v1/cache/state", responses=ERROR_RESPONSES)
    async def cache_state(cache_salt: str | None = None) -> dict[str, Any]:
        """The pool, the prefix tree and the requests; a salted block's text only with its `cache_salt`."""
        snapshot = await loop.call(lambda engine: engine.cache_state())
        snapshot = await asyncio.to_thread(state.visible_state, snapshot, cache_salt)
        snapshot["model"] = state.model_names[0]
        snapshot["num_waiting_http"] = loop.num_waiting
        snapshot["time"] = time.time()
        return snapshot

    # --- generation -----------------------------------------------------------------------------------
    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = state.model_name(body.model)
        body.check_supported()
        state.check_ids(body.stop_token_ids, "stop_token_ids")
        prompts = await state.encode_prompts(body.prompts())
        grammar = await state.compile_grammar(body)
        params = body.sampling_params(body.max_tokens, body.logprobs, grammar)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        group = await loop.add([(rid, p, params, body.cache_salt) for rid, p in zip(ids, prompts)])
        return await _respond(group, request, body, StreamRenderer(
            "completion", request_id, model, body.n, state.tokenizer, body.logprobs, body.include_usage,
            _hold_back(body.stop)), lambda outputs: completion_body(request_id, model, outputs, body.n,
                                                                    state.tokenizer, body.logprobs))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = state.model_name(body.model)
        body.check_supported()
        state.check_ids(body.stop_token_ids, "stop_token_ids")
        prompt = await state.render_chat(body.messages, body.add_generation_prompt)
        grammar = await state.compile_grammar(body)
        params = body.sampling_params(body.max_new_tokens, body.num_logprobs, grammar)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        group = await loop.add([(request_id, prompt, params, body.cache_salt)])
        return await _respond(group, request, body, StreamRenderer(
            "chat", request_id, model, body.n, state.tokenizer, body.num_logprobs, body.include_usage,
            _hold_back(body.stop)), lambda outputs: chat_body(request_id, model, outputs[0], state.tokenizer,
                                                              body.num_logprobs))

    install_openapi(app)
    return app


async def _respond(group: RequestGroup, request: Request, body: Any, renderer: StreamRenderer,
                   final_body: Callable[[list[Any]], dict]) -> Response:
    """The one way a generation request is answered: server-sent events, or one JSON body when done
    (499 when the client left first); a stream's teardown aborts the request."""
    if body.stream:
        return AbortingStreamingResponse(_events(group, renderer), group.abort)
    outputs = await _final(group, request)
    if outputs is None:
        return Response(status_code=499)
    return JSONResponse(final_body(outputs))


async def _final(group: RequestGroup, request: Request) -> list[Any] | None:
    """The finished outputs in prompt order, or None if the client left first (the requests are aborted)."""
    latest: dict[int, Any] = {}

    async def collect() -> None:
        async for update in group.updates():
            latest.update(update)

    try:
        finished, _ = await unless_disconnected(request, collect())
    except EngineFailure as failure:
        raise failure.error from None
    finally:
        group.abort()   # no-op when every request finished
    return [latest[i] for i in sorted(latest)] if finished else None


async def _events(group: RequestGroup, renderer: StreamRenderer):
    """The SSE body: chunks as tokens arrive, the usage chunk if asked for, then [DONE]."""
    try:
        async for update in group.updates():
            for line in renderer.chunks(update):
                yield line
        if renderer.include_usage:
            yield renderer.usage_chunk()
    except EngineFailure as failure:
        yield sse(failure.error.body())
    yield SSE_DONE


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(KVLabError)
    async def kvlab_error(request: Request, exc: KVLabError) -> JSONResponse:
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        return JSONResponse(bad_request(str(exc), code=code).body(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None   # the top-level field (deeper parts may be pydantic type tags)
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        else:
            message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                                f"{e.get('msg', 'invalid')}" for e in errors[:5])
        return JSONResponse(bad_request(message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, "internal server error", "internal_server_error").body(),
                            status_code=500)
