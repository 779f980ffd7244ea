"""`kvlab serve --speculative-config`: a real server subprocess on the shipped model (float64), driven by the
official `openai` client beside a server without speculation; greedy and seeded outputs are the same,
streamed or not, one at a time or batched; /metrics carries vLLM's spec_decode_* counters under `kvlab:`;
the cache state (and the explorer that draws it) shows each request's acceptance."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvlab
from kvlab import Engine, SamplingParams
from serve_helpers import chat_server, clean_exit

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
QUOTE = "To be, or not to be, that is the question. "
PROMPTS = [QUOTE * 3 + "To be,", "Who is there? Who is there? Who is there? Who",
           "Now is the winter of our discontent made glorious summer. Now is the winter", "The king"]
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
SEEDED = dict(temperature=0.8, seed=7, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(plain, speculative): the same model and flags, one with prompt lookup."""
    plain = chat_server(tmp_path_factory.mktemp("plain"))
    try:
        spec = chat_server(tmp_path_factory.mktemp("spec"), "--speculative-config", NGRAM)
    except Exception:
        plain.stop()
        raise
    yield plain, spec
    for proc in (plain, spec):
        assert clean_exit(proc.stop()), proc.log()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def complete(server, prompt: str, stream: bool, **kwargs) -> str:
    c = client(server)
    if not stream:
        return c.completions.create(model=c.models.list().data[0].id, prompt=prompt, **kwargs).choices[0].text
    chunks = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, stream=True, **kwargs)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def spec_metrics(server) -> tuple[dict[str, float], dict[int, float]]:
    """The kvlab:spec_decode_* counters, and the per-position one by position."""
    totals, per_pos = {}, {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            if not sample.name.startswith("kvlab:spec_decode"):
                continue
            if "position" in sample.labels:
                per_pos[int(sample.labels["position"])] = sample.value
            else:
                totals[sample.name] = sample.value
    return totals, per_pos


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completions_are_the_same_with_and_without_speculation(servers, sampling, stream):
    plain, spec = servers
    for prompt in PROMPTS:
        assert complete(spec, prompt, stream, **sampling) == complete(plain, prompt, stream, **sampling)


def test_batched_requests_and_chat_are_the_same_with_and_without_speculation(servers):
    plain, spec = servers
    jobs = [(p, s) for p in PROMPTS for s in (GREEDY, SEEDED)]

    def run(server):
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:  # concurrent: one engine batch
            return list(pool.map(lambda job: complete(server, job[0], False, **job[1]), jobs))

    assert run(spec) == run(plain)
    # several prompts in one request, n > 1 with a seed, and chat through the template
    for server_pair in [(plain, spec)]:
        got = []
        for server in server_pair:
            c = client(server)
            name = c.models.list().data[0].id
            many = c.completions.create(model=name, prompt=PROMPTS[:3], **GREEDY)
            forked = c.completions.create(model=name, prompt=PROMPTS[0], n=2, **SEEDED)
            chat = c.chat.completions.create(model=name, messages=[{"role": "user", "content": QUOTE * 2}],
                                             temperature=0, max_completion_tokens=24)
            got.append(([x.text for x in sorted(many.choices, key=lambda x: x.index)],
                        [x.text for x in sorted(forked.choices, key=lambda x: x.index)],
                        chat.choices[0].message.content))
        assert got[0] == got[1]
    for server in servers:
        state = server.wait_idle()
        assert state["num_used_blocks"] == 0


def test_metrics_count_drafts_as_vllm_names_them(servers):
    plain, spec = servers
    complete(spec, PROMPTS[0], False, **GREEDY)  # a copy: guesses made and kept
    totals, per_pos = spec_metrics(spec)
    drafts = totals["kvlab:spec_decode_num_drafts_total"]
    drafted = totals["kvlab:spec_decode_num_draft_tokens_total"]
    accepted = totals["kvlab:spec_decode_num_accepted_tokens_total"]
    assert 0 < drafts <= drafted and 0 < accepted <= drafted
    assert sum(per_pos.values()) == accepted and per_pos[0] > 0
    assert [per_pos[i] for i in sorted(per_pos)] == sorted(per_pos.values(), reverse=True)  # i+1 needs i
    stats = spec.cache_state()["stats"]
    assert stats["spec_decode_num_accepted_tokens"] == accepted
    plain_totals, plain_per_pos = spec_metrics(plain)
    assert set(plain_totals.values()) == {0.0} and plain_per_pos == {}


def test_the_cache_state_shows_each_requests_acceptance():
    """In process (no thread races a request in flight): the state between two steps carries each running
    request's guesses made and kept, and the explorer's column renders them."""
    model, tokenizer = kvlab.load(dtype="float64")
    engine = Engine(model, tokenizer, speculative_config=NGRAM)
    engine.add_request("copy", PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("other", PROMPTS[3], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(150):  # deterministic: until the copy has kept a guess (bounded in steps)
        engine.step()
        if any(s.num_accepted for s in engine.scheduler.running):
            break
    rows = {r["request_id"]: r for r in engine.cache_state()["requests"]}
    seqs = {s.request.request_id: s for s in engine.scheduler.running}
    for request_id, row in rows.items():
        assert row["num_drafted_tokens"] == seqs[request_id].num_drafted
        assert row["num_accepted_tokens"] == seqs[request_id].num_accepted <= row["num_drafted_tokens"]
    assert rows["copy"]["num_accepted_tokens"] > 0
    json.dumps(engine.cache_state())  # the server sends it as JSON


@pytest.mark.skipif(shutil.which("node") is None, reason="node is missing")
def test_the_explorer_renders_acceptance_per_request():
    source = (Path(__file__).resolve().parent.parent / "kvlab/serve/static/explorer.js").read_text()
    function = re.search(r"^function acceptance\(r\) \{.*?^\}", source, re.S | re.M).group(0)
    cases = [{"num_drafted_tokens": 10, "num_accepted_tokens": 7}, {"num_drafted_tokens": 0,
                                                                     "num_accepted_tokens": 0}, {}]
    script = function + f"\nconsole.log(JSON.stringify({json.dumps(cases)}.map(acceptance)));"
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == ["7/10 (70 %)", "-", "-"]
    html = (Path(__file__).resolve().parent.parent / "kvlab/serve/static/index.html").read_text()
    assert "<th title=\"speculative guesses accepted / drafted\">accepted</th>" in html
