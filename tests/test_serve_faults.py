"""The server's engine loop under faults and heavy requests, in process (uvicorn on a thread) so a test can
reach inside: a step that raises for one request fails only that request (issue 22 item 4), and
tokenization never runs on the event loop, so a huge prompt does not stall /health (item 2); /pause holds
every request between two steps and /resume carries on to the same text.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

import kvlab
from kvlab.model.llama import LlamaModel
from kvlab.engine.engine import Engine
from kvlab.serve.app import create_app
from serve_helpers import InProcessServer

PROMPTS = ["Now is the winter of our discontent", "Friends, Romans, countrymen", "Once more unto the breach",
           "All the world's a stage", "If music be the food of love"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return kvlab.load(dtype="float64")


def start(model_and_tokenizer, enable_pause: bool = False, max_waiting: int = 256,
          **engine_kw) -> InProcessServer:
    model, tokenizer = model_and_tokenizer
    app = create_app(Engine(model, tokenizer, **engine_kw), tokenizer, model_names=["bard"],
                     enable_pause=enable_pause, max_waiting=max_waiting)
    return InProcessServer(app)


def reference(model_and_tokenizer, ids: list[int], max_tokens: int) -> str:
    model, tokenizer = model_and_tokenizer
    return tokenizer.decode(kvlab.generate(model, [ids], max_tokens)[0].tolist())


def test_a_step_that_raises_for_one_request_fails_only_that_request(model_and_tokenizer, monkeypatch):
    """Five streams are running when a poisoned request joins their batch and the step raises: the poisoned
    one gets a 500, the five finish with exactly their reference text, and the pool is balanced after."""
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    expected = [reference(model_and_tokenizer, ids, MAX_TOKENS) for ids in prompts]
    seen = {t for ids in prompts for t in ids} | {t for text in expected for t in tokenizer.encode(text)}
    poison = next(t for t in range(100, 4096) if t not in seen)   # a token none of the others ever holds
    real_forward = LlamaModel.forward_batch  # the engine's step: one batched forward over the pool
    gate = threading.Event()
    gate.set()
    failures: list[int] = []   # sequences in each batch that raised

    def faulty_forward(model, batch, *args, **kwargs):
        gate.wait(60)
        if poison in np.asarray(batch.token_ids).tolist():
            failures.append(len(batch.query_lens))
            raise RuntimeError("injected fault: the poisoned token reached the model")
        return real_forward(model, batch, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "forward_batch", faulty_forward)
    server = start(model_and_tokenizer)
    try:
        first_chunk = threading.Barrier(len(prompts) + 1, timeout=60)

        def stream(ids: list[int]) -> tuple[str, str]:
            body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
            text, lines, waited = "", [], False
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        lines.append(line)
                        if '"text"' in line:
                            text += json.loads(line[6:])["choices"][0]["text"]
                        if not waited:
                            waited = True
                            first_chunk.wait()
            return text, "\n".join(lines)

        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            streams = [pool.submit(stream, ids) for ids in prompts]
            first_chunk.wait()          # every stream is running
            gate.clear()                # hold the engine inside its next forward ...
            culprit = pool.submit(server.post, "/v1/completions",
                                  {"prompt": prompts[0][:3] + [poison], "max_tokens": 4, "temperature": 0})
            while server.engine_loop.num_waiting == 0 and not culprit.done():
                threading.Event().wait(0.01)   # ... until the poisoned request is on its way in
            gate.set()
            answer = culprit.result(60)
            results = [s.result(60) for s in streams]
        assert answer.status_code == 500, answer.text
        assert answer.json()["error"]["type"] == "internal_server_error"
        assert failures and failures[0] > 1   # it raised in a batch shared with others
        assert all(n == 1 for n in failures[1:])   # then alone, when rerun one by one
        for (text, raw), want in zip(results, expected):
            assert '"error"' not in raw and text == want
        state = server.get("/v1/cache/state").json()
        assert state["requests"] == [] and state["num_used_blocks"] == 0
        assert state["num_free_blocks"] == state["num_blocks"]
        assert server.get("/health").status_code == 200
        again = server.post("/v1/completions", {"prompt": prompts[1], "max_tokens": 5, "temperature": 0,
                                                "ignore_eos": True})
        assert again.json()["choices"][0]["text"] == reference(model_and_tokenizer, prompts[1], 5)
    finally:
        gate.set()
        server.stop()


def test_tokenization_runs_off_the_event_loop(model_and_tokenizer, monkeypatch):
    """A tokenization that does not end until /health has answered: /health answers (the event loop is
    free), and the encode ran on a worker thread, not the loop's."""
    model, tokenizer = model_and_tokenizer
    server = start(model_and_tokenizer)
    release = threading.Event()
    threads: list[str] = []
    real_encode = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        release.wait(60)
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    try:
        with ThreadPoolExecutor(2) as pool:
            pending = pool.submit(server.post, "/v1/completions", {"prompt": "Alas, poor Yorick", "max_tokens": 2})
            while not threads:
                threading.Event().wait(0.01)
            health = server.get("/health")   # answered while the encode is still held
            release.set()
            done = pending.result(60)
        assert health.status_code == 200 and done.status_code == 200
        assert threads[0] != "uvicorn" and threads[0] != threading.main_thread().name
    finally:
        release.set()
        server.stop()


def test_pause_holds_requests_between_steps_and_resume_finishes_them(model_and_tokenizer, monkeypatch):
    """Paused (from inside the loop, after the third step, so no clock decides when) the running request keeps
    its tokens while the loop answers calls, a new one queues; resumed, both finish with the reference text.
    Without --enable-pause the routes do not exist."""
    model, tokenizer = model_and_tokenizer
    plain = start(model_and_tokenizer)
    try:
        assert plain.post("/pause").status_code == 404 and plain.get("/is_paused").status_code == 404
    finally:
        plain.stop()
    server = start(model_and_tokenizer, enable_pause=True)
    real_forward = LlamaModel.forward_batch
    steps: list[int] = []

    def counting_forward(model, batch, *args, **kwargs):
        steps.append(len(batch.query_lens))
        if len(steps) == 3:
            server.engine_loop.set_paused(True)   # takes effect before the next step
        return real_forward(model, batch, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "forward_batch", counting_forward)
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(server.post, "/v1/completions", {**body, "prompt": PROMPTS[0]})
            while server.get("/is_paused").json() != {"is_paused": True}:
                threading.Event().wait(0.01)
            held = [server.get("/v1/cache/state").json()["requests"] for _ in range(3)]   # three loop turns
            assert all([(r["status"], r["num_output_tokens"]) for r in h] == [("running", 3)] for h in held), held
            second = pool.submit(server.post, "/v1/completions", {**body, "prompt": PROMPTS[1]})
            while len(server.get("/v1/cache/state").json()["requests"]) < 2:
                threading.Event().wait(0.01)
            assert len(steps) == 3   # nothing ran while paused
            assert server.post("/resume").json() == {"paused": False}
            texts = [f.result(60).json()["choices"][0]["text"] for f in (first, second)]
        assert texts == [reference(model_and_tokenizer, tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS[:2]]
        assert server.get("/is_paused").json() == {"is_paused": False}
    finally:
        server.engine_loop.set_paused(False)
        server.stop()


def test_full_queue_gets_429_and_shutdown_aborts_running_and_waiting_with_503(model_and_tokenizer, monkeypatch):
    """One seat, one waiting slot. Paused from inside the loop after the first step (no clock decides), the
    running request cannot finish: a waiting stream fills the queue, a third request gets 429 with
    Retry-After; shutting down then answers the running request 503 and ends the stream with the error
    event and [DONE]. (tests/test_serve.py repeats the 429 and the 503 on a real `kvlab serve` process.)"""
    server = start(model_and_tokenizer, enable_pause=True, max_waiting=1, max_num_seqs=1)
    real_forward = LlamaModel.forward_batch

    def pausing_forward(model, batch, *args, **kwargs):
        server.engine_loop.set_paused(True)   # takes effect before the next step
        return real_forward(model, batch, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "forward_batch", pausing_forward)
    body = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    def stream() -> list[str]:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            return [line for line in r.iter_lines() if line]

    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(server.post, "/v1/completions", body)
            while server.get("/is_paused").json() != {"is_paused": True}:
                threading.Event().wait(0.01)
            waiting = pool.submit(stream)
            while [r["status"] for r in server.get("/v1/cache/state").json()["requests"]] != ["running", "waiting"]:
                threading.Event().wait(0.01)
            refused = server.post("/v1/completions", body)
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
            assert refused.headers["retry-after"] == "1"
            server.engine_loop.begin_shutdown(0)
            answer, events = running.result(60), waiting.result(60)
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable"
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["type"] == "service_unavailable"
    finally:
        server.engine_loop.set_paused(False)
        server.stop()
