"""Structured output through `kvlab serve`: a real server subprocess on the shipped model, the official `openai`
client (response_format with a JSON schema or a pydantic model through `.parse`, vLLM's structured_outputs
and llama.cpp's grammar/json_schema through extra_body), every finished answer validated with `jsonschema`,
streaming equal to non-streaming, and bad grammars refused with a 400 that names them before any engine work.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from serve_helpers import chat_server, clean_exit
from test_structured_grammar import SCHEMAS

MESSAGES = [{"role": "user", "content": "Who speaks, and how?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = chat_server(tmp_path_factory.mktemp("structured"), "--served-model-name", "bard")
    yield proc
    assert clean_exit(proc.stop()), proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def assert_idle(server) -> None:
    state = server.wait_idle()
    assert state["num_used_blocks"] == 0 and state["num_free_blocks"] == state["num_blocks"]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema_streams_what_it_returns_and_every_finished_answer_validates(
        server, client, name):
    kwargs = dict(model="bard", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=7, n=3,
                  response_format=json_schema_format(name))
    whole = client.chat.completions.create(**kwargs)
    streamed: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert [streamed[c.index] for c in whole.choices] == [c.message.content for c in whole.choices]
    assert [reasons[c.index] for c in whole.choices] == [c.finish_reason for c in whole.choices]
    for choice in whole.choices:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    greedy = client.chat.completions.create(**{**kwargs, "temperature": 0, "n": 1})
    if greedy.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(greedy.choices[0].message.content), SCHEMAS[name])
    finished = [c for c in [*whole.choices, *greedy.choices] if c.finish_reason == "stop"]
    assert len(finished) >= 2, [c.message.content for c in whole.choices]  # the validation above ran
    assert_idle(server)


class Speaker(BaseModel):
    name: str = Field(max_length=10)
    rank: Literal["king", "lord", "fool"]
    age: int = Field(ge=1, le=99)


class Scene(BaseModel):
    speakers: list[Speaker] = Field(min_length=1, max_length=2)
    mood: Literal["merry", "grim"]


def test_parse_with_a_pydantic_model(client):
    """openai's `.parse`: the model's strict JSON schema as response_format; the answer comes back parsed."""
    for parse in (client.chat.completions.parse, client.beta.chat.completions.parse):
        completion = parse(model="bard", messages=MESSAGES, response_format=Scene, max_tokens=120,
                           temperature=0)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Scene)
        assert Scene.model_validate_json(choice.message.content) == choice.message.parsed


def test_vllm_structured_outputs_on_completions_and_chat(client):
    cases = [({"regex": r"[A-Z][a-z]{2,6} [0-9]{1,3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", t)),
             ({"choice": ["aye", "nay", "perchance"]}, lambda t: t in ("aye", "nay", "perchance")),
             ({"grammar": 'root ::= "my " ("lord" | "liege") "!"'}, lambda t: t in ("my lord!", "my liege!")),
             ({"json": SCHEMAS["ranges"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["ranges"]) is None),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    for so, valid in cases:
        for temperature in (0.0, 1.0):
            done = client.completions.create(model="bard", prompt="KING:", max_tokens=60, temperature=temperature,
                                             seed=3, n=2, extra_body={"structured_outputs": so})
            chat = client.chat.completions.create(model="bard", messages=MESSAGES, max_tokens=60, seed=3,
                                                  temperature=temperature, extra_body={"structured_outputs": so})
            texts = [(c.text, c.finish_reason) for c in done.choices] + \
                [(c.message.content, c.finish_reason) for c in chat.choices]
            for text, reason in texts:
                if reason == "stop":
                    assert valid(text), (so, text)
            if "json_object" not in so:  # the free-form object may ramble to the limit
                assert all(reason == "stop" for _, reason in texts), (so, texts)


def test_llama_cpp_grammar_and_json_schema_fields(client):
    gbnf = 'root ::= answer "." \nanswer ::= "yes" | "no" | "[" [0-9] "]"'
    done = client.completions.create(model="bard", prompt="Speak:", max_tokens=10, temperature=1.0, seed=1, n=4,
                                     extra_body={"grammar": gbnf})
    assert all(re.fullmatch(r"(yes|no|\[[0-9]\])\.", c.text) and c.finish_reason == "stop" for c in done.choices)
    chat = client.chat.completions.create(model="bard", messages=MESSAGES, max_tokens=60, temperature=0,
                                          extra_body={"json_schema": SCHEMAS["enum"]})
    assert json.loads(chat.choices[0].message.content)["mood"] in ("merry", "sad", "wroth")


def test_an_answer_cut_by_max_tokens_says_length(client):
    cut = client.chat.completions.create(model="bard", messages=MESSAGES, max_tokens=3, temperature=0,
                                         response_format=json_schema_format("nested"))
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content.startswith("{")
    free = client.chat.completions.create(model="bard", messages=MESSAGES, max_tokens=3, temperature=0,
                                          response_format={"type": "text"})
    assert free.choices[0].finish_reason in ("stop", "length")


BIG_GRAMMAR = "start: " + " | ".join(f'"w{i}" x' for i in range(20000)) + '\nx: "a" | "b"'


@pytest.mark.parametrize("path, extra, param, needle", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "invalid JSON schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "'xml' is not supported"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ("completion", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "invalid regex"),
    ("completion", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("completion", {"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ("completion", {"grammar": "root ::= missing"}, "grammar", "invalid grammar"),
    ("completion", {"grammar": BIG_GRAMMAR}, "grammar", "too big"),
    ("chat", {"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema", "one way"),
    ("chat", {"json_schema": {"type": "object"}, "stop": ["}"]}, None, "stop strings"),
])
def test_bad_structured_requests_get_400_naming_the_problem(server, path, extra, param, needle):
    body = {"model": "bard", "max_tokens": 5, **extra}
    if path == "chat":
        url, body["messages"] = "/v1/chat/completions", MESSAGES
    else:
        url, body["prompt"] = "/v1/completions", "KING:"
    reply = httpx.post(server.url + url, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert needle in error["message"] and error["param"] == param, error
    state = server.cache_state()
    assert state["stats"]["num_prompt_tokens"] == before_prompt_tokens(server, state)


_SEEN: dict[str, int] = {}


def before_prompt_tokens(server, state) -> int:
    """The engine's prompt-token count seen at the first bad request: refusals must never add to it."""
    return _SEEN.setdefault(server.url, state["stats"]["num_prompt_tokens"])
