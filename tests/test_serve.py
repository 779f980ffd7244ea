"""`kvlab serve` end to end: a real server subprocess on the shipped model, driven by the official `openai`
client (sync, async, streaming), by raw HTTP for what clients must not be able to break, and checked
against the engine's own accounting (/v1/cache/state) and /metrics after every workload.

The main server computes in float64, where the engine's tokens do not depend on the batch they run in, so
"concurrent equals one by one" is an exact comparison.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import kvlab
from serve_helpers import ServerProcess, chat_server, clean_exit

SYSTEM = ("You are a player in a company of actors. Speak in verse, as the Bard would, and keep to the "
          "scene that is set for you. ")
QUESTIONS = ["Who is there?", "What news from Rome?", "Where is the king?", "Is this a dagger?",
             "What light through yonder window breaks?", "Shall I compare thee?"]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return kvlab.load(dtype="float64")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    proc = chat_server(tmp, "--served-model-name", "bard", "kvlab-default", "--max-waiting", "64")
    yield proc
    assert clean_exit(proc.stop()), proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def reference_text(model_and_tokenizer, prompt_ids: list[int], max_tokens: int) -> str:
    """Greedy tokens from kvlab's single-sequence generate (no engine, no server), as text."""
    model, tokenizer = model_and_tokenizer
    tokens = kvlab.generate(model, [prompt_ids], max_tokens)[0].tolist()
    return tokenizer.decode(tokens)


def assert_idle_and_balanced(server: ServerProcess) -> dict:
    state = server.wait_idle()
    assert state["num_used_blocks"] == 0
    # cached-evictable blocks count as free (vLLM): with nothing running every block is free
    assert state["num_free_blocks"] == state["num_blocks"] >= state["num_cached_blocks"]
    assert all(b["ref_count"] == 0 and b["hash"] for b in state["blocks"])
    metrics = server.metrics()
    assert metrics["kvlab:kv_cache_usage_perc"] == 0.0
    assert metrics["kvlab:num_requests_running"] == 0 and metrics["kvlab:num_requests_waiting"] == 0
    assert metrics["kvlab:prompt_tokens_total"] == state["stats"]["num_prompt_tokens"]
    assert metrics["kvlab:generation_tokens_total"] == state["stats"]["num_generation_tokens"]
    return state


# --- the openai client ---------------------------------------------------------------------------------------
def test_models_and_a_greedy_completion_equal_the_reference(server, client, model_and_tokenizer):
    assert [m.id for m in client.models.list().data] == ["bard", "kvlab-default"]
    prompt = "To be, or not to be,"
    done = client.completions.create(model="bard", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body=IGNORE_EOS)
    ids = model_and_tokenizer[1].encode(prompt)
    assert done.choices[0].text == reference_text(model_and_tokenizer, ids, 12)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 12
    assert done.usage.prompt_tokens_details.cached_tokens == 0
    # token ids in, the second name served, and OpenAI's default of 16 new tokens for completions
    again = client.completions.create(model="kvlab-default", prompt=ids, temperature=0, extra_body=IGNORE_EOS)
    assert again.usage.completion_tokens == 16 and again.model == "kvlab-default"
    assert again.choices[0].text.startswith(done.choices[0].text)


def test_chat_through_the_template_runs_to_the_context_end_by_default(server, client, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    system = SYSTEM * 4   # a long prompt leaves a short way to the end of the context
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who is there?"}]
    reply = client.chat.completions.create(model="bard", messages=messages, temperature=0,
                                           max_completion_tokens=10, extra_body=IGNORE_EOS)
    rendered = f"<s>system: {system}\nuser: Who is there?\nassistant:"
    ids = tokenizer.encode(rendered, add_bos=False)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == reference_text(model_and_tokenizer, ids, 10)
    # no max_tokens: chat runs to EOS or to the end of the context (vLLM's chat default)
    long = client.chat.completions.create(model="bard", messages=messages, temperature=0, extra_body=IGNORE_EOS)
    room = model.config.max_position_embeddings - len(ids)
    assert long.usage.completion_tokens == room
    assert long.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming_and_reports_usage(server, client):
    kwargs = dict(model="bard", prompt="Now is the winter of our discontent", max_tokens=20, temperature=0,
                  extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])
    # chat streams a role first, then content
    messages = [{"role": "user", "content": "What news?"}]
    chat = client.chat.completions.create(model="bard", messages=messages, max_tokens=8, temperature=0,
                                          extra_body=IGNORE_EOS)
    pieces = list(client.chat.completions.create(model="bard", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body=IGNORE_EOS))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == chat.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == "length"


def test_batched_prompts_and_n_number_their_choices(server, client):
    prompts = ["Fair is foul", "and foul is fair"]
    kwargs = dict(model="bard", max_tokens=5, temperature=0.7, seed=11, n=2, extra_body=IGNORE_EOS)
    batch = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = [c.text for p in prompts for c in client.completions.create(prompt=p, **kwargs).choices]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.completion_tokens == 20
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == alone


def test_cache_state_shows_a_running_request_and_its_blocks(server, model_and_tokenizer):
    num_prompt = len(model_and_tokenizer[1].encode(SYSTEM))
    body = {"prompt": SYSTEM, "max_tokens": 256 - num_prompt, "temperature": 0, "stream": True,
            "ignore_eos": True}
    seen: list[dict] = []
    done = threading.Event()

    def poll() -> None:   # snapshots while the request runs (it is fast: poll, do not sleep)
        while not done.is_set() and not seen:
            state = server.cache_state()
            if any(q["num_prompt_tokens"] == num_prompt and q["status"] == "running" and q["block_table"]
                   for q in state["requests"]):
                seen.append(state)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            r.read()
    finally:
        done.set()
        poller.join(30)
    assert seen, "no snapshot caught the request running"
    state = seen[0]
    (mine,) = [q for q in state["requests"] if q["num_prompt_tokens"] == num_prompt]
    held = {b["id"]: b for b in state["blocks"] if b["ref_count"] > 0}
    assert set(mine["block_table"]) <= set(held) and state["num_used_blocks"] >= len(mine["block_table"])
    first = held[mine["block_table"][0]]
    assert SYSTEM.startswith(first["text"].lstrip()) and 1 <= first["num_tokens"] <= 16
    assert server.wait_idle()["num_used_blocks"] == 0


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": "Once more", "max_tokens": 3, "stream": True, "temperature": 0}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_async_client_streams_concurrently(server, model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]

    async def one(aclient, question):
        stream = await aclient.completions.create(model="bard", prompt=SYSTEM + question, max_tokens=10,
                                                  temperature=0, stream=True, extra_body=IGNORE_EOS)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, q) for q in QUESTIONS[:4]))

    texts = asyncio.run(main())
    for question, text in zip(QUESTIONS, texts):
        assert text == reference_text(model_and_tokenizer, tokenizer.encode(SYSTEM + question), 10)


def test_shared_prefix_is_reported_as_cached_tokens(server, client, model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    prefix = SYSTEM * 2
    assert server.post("/reset_prefix_cache").json() == {"reset": True}
    first = client.completions.create(model="bard", prompt=prefix + "Who goes there?", max_tokens=2,
                                      temperature=0)
    second = client.completions.create(model="bard", prompt=prefix + "Stand, and unfold yourself.",
                                       max_tokens=2, temperature=0)
    a, b = tokenizer.encode(prefix + "Who goes there?"), tokenizer.encode(prefix + "Stand, and unfold yourself.")
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # token-granular: every row of the common prefix (whole blocks, then the first rows of the block they part in)
    assert second.usage.prompt_tokens_details.cached_tokens == min(common, len(b) - 1) > 16
    # another tenant's salt never shares blocks
    salted = client.completions.create(model="bard", prompt=prefix + "Stand, and unfold yourself.",
                                       max_tokens=2, temperature=0, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].text == second.choices[0].text
    # after a reset nothing is cached
    assert server.post("/reset_prefix_cache").json() == {"reset": True}
    again = client.completions.create(model="bard", prompt=prefix + "Who goes there?", max_tokens=2,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert server.cache_state()["stats"]["prefix_cache_hits"] >= second.usage.prompt_tokens_details.cached_tokens


def test_concurrent_requests_from_threads_equal_one_by_one(server, client):
    jobs = [dict(prompt=SYSTEM + q, max_tokens=3 + 2 * (i % 4)) for i, q in enumerate(QUESTIONS + QUESTIONS[:2])]
    jobs += [dict(prompt="Friends, Romans, countrymen", max_tokens=9, n=2, temperature=0.9, seed=5)]

    def run(job):
        kwargs = {"temperature": 0, **job}
        done = client.completions.create(model="bard", extra_body=IGNORE_EOS, **kwargs)
        return [c.text for c in sorted(done.choices, key=lambda c: c.index)]

    one_by_one = [run(job) for job in jobs]
    server.post("/reset_prefix_cache")
    with ThreadPoolExecutor(max_workers=6) as pool:
        together = list(pool.map(run, jobs))
    assert together == one_by_one
    assert len(set(one_by_one[-1])) == 2   # n=2 with a seed: two different, reproducible samples
    assert_idle_and_balanced(server)


def test_requests_on_different_connections_share_engine_steps(server):
    """Continuous batching across HTTP requests: six concurrent requests take far fewer engine steps than
    the same requests one after another would."""
    clients, max_tokens = 6, 32
    steps_before = server.cache_state()["stats"]["num_steps"]
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(max_workers=clients) as pool:
        done = list(pool.map(lambda q: server.post("/v1/completions", {**body, "prompt": q}), QUESTIONS))
    assert all(r.status_code == 200 for r in done)
    steps = server.cache_state()["stats"]["num_steps"] - steps_before
    assert steps < clients * max_tokens / 2, steps   # one by one would take at least clients * max_tokens


def test_stop_strings_cut_the_text_in_both_modes(server, client):
    base = client.completions.create(model="bard", prompt="Good morrow, my lord", max_tokens=24, temperature=0,
                                     extra_body=IGNORE_EOS).choices[0].text
    stop = base[8:11]
    assert stop.strip()
    kwargs = dict(model="bard", prompt="Good morrow, my lord", max_tokens=24, temperature=0, stop=[stop],
                  extra_body=IGNORE_EOS)
    cut = client.completions.create(**kwargs).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == cut.text


def test_logprobs_in_both_shapes(server, client):
    done = client.completions.create(model="bard", prompt="My kingdom for", max_tokens=4, temperature=0,
                                     logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == done.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and chosen == pytest.approx(max(top.values())) and chosen <= 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="bard", prompt="My kingdom for", max_tokens=4, temperature=0, logprobs=3, stream=True)]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    chat = client.chat.completions.create(model="bard", messages=[{"role": "user", "content": "Speak."}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_tokenize_and_detokenize(server, model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    body = server.post("/tokenize", {"prompt": "Alas, poor Yorick!"}).json()
    assert body["tokens"] == tokenizer.encode("Alas, poor Yorick!") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256
    assert server.post("/detokenize", {"tokens": body["tokens"]}).json()["prompt"] == "Alas, poor Yorick!"
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tokenizer.encode("<s>user: hi\nassistant:", add_bos=False)


# --- what clients must not be able to break ---------------------------------------------------------------------
BAD_BODIES = [
    ("/v1/completions", b'{"prompt": "x",', None),
    ("/v1/completions", b'["not", "an", "object"]', None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": -3}, "seed"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2, 999999]}, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], ["a"]]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/detokenize", {"tokens": [5, 10**6]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD_BODIES)
def test_invalid_bodies_get_400_in_openai_shape(server, path, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    response = httpx.post(f"{server.url}{path}", timeout=30, **kw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.floats(allow_nan=True),
                 st.text(max_size=6), st.lists(st.integers(-3, 5000), max_size=4))
FIELDS = {
    "prompt": st.one_of(JUNK, st.text(max_size=40), st.lists(st.integers(-2, 4100), max_size=20),
                        st.lists(st.lists(st.integers(0, 4095), max_size=6), max_size=3)),
    "max_tokens": st.one_of(JUNK, st.integers(-2, 6)), "n": st.one_of(JUNK, st.integers(0, 3)),
    "temperature": st.one_of(JUNK, st.floats(-1, 3)), "top_p": JUNK, "top_k": JUNK, "min_p": JUNK,
    "seed": st.one_of(JUNK, st.integers(-2**70, 2**70)), "stop": st.one_of(JUNK, st.lists(st.text(max_size=3))),
    "stop_token_ids": JUNK, "logprobs": st.one_of(JUNK, st.integers(-1, 25)), "stream": st.booleans(),
    "ignore_eos": JUNK, "cache_salt": JUNK, "model": st.sampled_from(["bard", "other", None]),
}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional=FIELDS))
def test_random_bodies_never_break_the_loop(server, body):
    """Whatever a client sends: a 200 (a stream that ends in [DONE]) or an OpenAI-shaped 4xx, never a 500."""
    raw = json.dumps(body).encode()   # NaN and Infinity go through as JavaScript clients send them
    with httpx.stream("POST", f"{server.url}/v1/completions", content=raw, timeout=60,
                      headers={"content-type": "application/json"}) as response:
        text = response.read().decode()
    assert response.status_code in (200, 400, 404), (body, response.status_code, text)
    if response.status_code != 200:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    else:
        assert json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_after_random_bodies_every_block_is_free(server):
    assert_idle_and_balanced(server)
    assert server.get("/health").status_code == 200


def test_context_overflow_unknown_model_and_a_healthy_loop_after(server, client):
    long = "Speak the speech, I pray you, as I pronounced it to you. " * 30
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="bard", prompt=long, max_tokens=5)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="bard", prompt="short", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert info.value.code == "model_not_found"
    ok = client.completions.create(model="bard", prompt="Still alive?", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    assert server.get("/health").status_code == 200
    assert server.get("/no/such/route").json()["error"]["type"] == "not_found_error"


def finished_count(server: ServerProcess, reason: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(server.get("/metrics").text) for s in f.samples
               if s.name == "kvlab:request_success_total" and s.labels.get("finished_reason") == reason)


def test_disconnect_storm_aborts_within_a_step_and_frees_every_block(server, model_and_tokenizer):
    """Clients that hang up mid-stream, and one that leaves while its non-streaming answer is computed:
    the server's own abort counter counts every one, none ran to its end, and the pool is balanced after.
    Nothing here waits on a client timeout: each client leaves at a point the server reports."""
    tokenizer = model_and_tokenizer[1]
    aborted, ran_out = finished_count(server, "abort"), finished_count(server, "length")
    clients = 12
    room = 256 - len(tokenizer.encode(SYSTEM))   # to the end of the context: hundreds of steps to go
    body = {"prompt": SYSTEM, "max_tokens": room, "temperature": 0, "stream": True, "ignore_eos": True}

    def hang_up(i: int) -> int:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "seed": i}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return 1   # leave after the first token: closes the connection mid-stream
        return 0

    with ThreadPoolExecutor(max_workers=clients) as pool:
        assert sum(pool.map(hang_up, range(clients))) == clients
    # a non-streaming request whose client leaves once the server shows it running
    prompt = SYSTEM + "Exeunt."
    num_prompt = len(tokenizer.encode(prompt))
    payload = json.dumps({**body, "prompt": prompt, "max_tokens": 256 - num_prompt, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: any(q["num_prompt_tokens"] == num_prompt for q in server.cache_state()["requests"]))
    wait_for(lambda: finished_count(server, "abort") >= aborted + clients + 1)
    state = assert_idle_and_balanced(server)
    assert finished_count(server, "abort") == aborted + clients + 1
    assert finished_count(server, "length") == ran_out   # none of them ran to its end
    assert state["stats"]["num_running"] == 0


def test_metrics_carry_vllm_names(server):
    text = server.get("/metrics").text
    for name in ["kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "num_requests_running", "num_requests_waiting", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket"]:
        assert f"kvlab:{name}{{" in text, name
    metrics = server.metrics()
    assert metrics["kvlab:time_to_first_token_seconds_count"] > 0
    assert metrics["kvlab:inter_token_latency_seconds_count"] > 0
    assert metrics["kvlab:prefix_cache_hits_total"] > 0
    assert_idle_and_balanced(server)


# --- servers with other settings ------------------------------------------------------------------------------
def test_api_key_guards_the_api_and_chat_needs_a_template(tmp_path):
    proc = ServerProcess("--max-model-len", "64", log_dir=tmp_path, env={"KVLAB_API_KEY": "sekrit"})
    try:
        denied = proc.get("/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert proc.post("/v1/completions", {"prompt": "x"}).status_code == 401
        assert proc.post("/tokenize", {"prompt": "x"}).status_code == 401
        assert proc.get("/health").status_code == 200 and proc.get("/metrics").status_code == 200
        assert proc.get("/").status_code == 200
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="sekrit", max_retries=0)
        assert client.models.list().data[0].id == "shakespeare"
        assert client.models.list().data[0].max_model_len == 64
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{proc.url}/v1", api_key="wrong", max_retries=0).models.list()
        # --max-model-len reaches the engine
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="shakespeare", prompt="word " * 40, max_tokens=30)
        # the shipped model has no chat template: refused, as vLLM does
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="shakespeare", messages=[{"role": "user", "content": "hi"}])
        assert "chat template" in info.value.message
    finally:
        assert clean_exit(proc.stop()), proc.log()


def test_full_waiting_queue_gets_429_and_shutdown_gets_503(tmp_path):
    """On a real `kvlab serve` process: paused before anything runs (so no request can finish, however fast
    the machine), one request fills the one waiting slot, the next gets 429 with Retry-After, and SIGTERM
    answers the queued one 503 and exits cleanly. The running-and-streaming case of the same rules is
    tests/test_serve_faults.py's (paused from inside the loop)."""
    proc = ServerProcess("--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "0",
                         "--enable-pause", log_dir=tmp_path)
    body = {"prompt": "Once more unto the breach", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    results: dict[str, httpx.Response] = {}

    def post(name: str) -> None:
        results[name] = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60)

    try:
        assert proc.post("/pause", {}).json() == {"paused": True}
        assert proc.get("/is_paused").json() == {"is_paused": True}
        queued = threading.Thread(target=post, args=("queued",))
        queued.start()
        wait_for(lambda: [r["status"] for r in proc.cache_state()["requests"]] == ["waiting"])
        refused = proc.post("/v1/completions", body)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.headers["retry-after"] == "1"   # can fit later: the SDK's retry waits for it
        # shutting down: the request in flight is aborted with 503 and the process exits cleanly
        assert clean_exit(proc.stop(signal.SIGTERM)), proc.log()
        queued.join(30)
        assert results["queued"].status_code == 503, results["queued"].text
        assert results["queued"].json()["error"]["type"] == "service_unavailable"
    finally:
        proc.stop(signal.SIGKILL)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def test_bad_flags_fail_before_loading(tmp_path):
    import subprocess
    import sys

    both = subprocess.run([sys.executable, "-m", "kvlab", "serve", "--kv_cache_memory", "1MiB", "--num-blocks", "4"],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "not both" in both.stderr
    missing = subprocess.run([sys.executable, "-m", "kvlab", "serve", "--model", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such model folder" in missing.stderr
