"""Scale-out as a user runs it: `kvlab serve` processes sharing a real Valkey tier, a disk tier across a
restart, a dead tier, and the real `vllm-router --policy kv_aware` reading kvlab's KV events."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from serve_helpers import ROOT, ServerProcess, clean_exit, free_port, wait_healthy
from valkey_helpers import ValkeyProcess

TEXT = (ROOT / "kvlab/models/shakespeare/validation.txt").read_text()[2000:2560]
WAIT_S = 90


def complete(server: ServerProcess, prompt: str, max_tokens: int = 12):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def serve(tmp_path: Path, *args: str) -> ServerProcess:
    server = ServerProcess("--served-model-name", "shakespeare", *args, log_dir=tmp_path)
    server.model = "shakespeare"
    return server


def wait_metric(server: ServerProcess, name: str, predicate) -> float:
    """Poll /metrics until `predicate(value)` (the server's own count of an event that must happen)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = server.metrics().get(name, 0.0)
        if predicate(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"{name} stayed at {server.metrics().get(name)}:\n{server.log()}")


def best_hit(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // 16 * 16  # whole blocks, the last token always computed


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_instance_b_answers_from_the_blocks_instance_a_computed(tmp_path):
    valkey = ValkeyProcess(tmp_path)
    a = b = None
    try:
        a = serve(tmp_path, "--kv-tier", valkey.url)
        b = serve(tmp_path, "--kv-tier", valkey.url)
        first = complete(a, TEXT)
        n = first.usage.prompt_tokens
        assert n > 150 and first.usage.prompt_tokens_details.cached_tokens == 0
        wait_metric(a, "kvlab:kv_tier_written_blocks_total", lambda v: v >= (n + 11) // 16)
        second = complete(b, TEXT)
        assert second.usage.prompt_tokens_details.cached_tokens == best_hit(n) >= 0.9 * n
        assert second.choices[0].text == first.choices[0].text
        metrics = b.metrics()
        assert metrics["kvlab:kv_tier_hit_tokens_total"] == best_hit(n)
        assert metrics["kvlab:kv_tier_refused_entries_total"] == 0 and metrics["kvlab:kv_tier_errors_total"] == 0
    finally:
        for server in (a, b):
            if server is not None:
                server.stop()
        valkey.stop()


def test_a_dead_tier_fails_nothing_and_a_restart_is_warm_from_the_disk_tier(tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0?timeout=0.5&retry=0"  # nothing listens there
    args = ("--kv-tier", dead, "--kv-tier", f"file://{tmp_path}/disk-tier")
    server = serve(tmp_path, *args)
    try:
        prompts = [TEXT, TEXT[:400] + " And so we part.", TEXT[100:]]
        answers = [complete(server, p) for p in prompts]  # every request answered
        assert all(a.choices[0].finish_reason == "length" for a in answers)
        assert server.metrics()["kvlab:kv_tier_errors_total"] >= 1  # the dead tier was tried, and skipped
    finally:
        assert clean_exit(server.stop())  # SIGTERM: the write queue drains before exit
    restarted = serve(tmp_path, *args)
    try:
        for prompt, before in zip(prompts, answers):
            again = complete(restarted, prompt)
            n = again.usage.prompt_tokens
            assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * n
            assert again.choices[0].text == before.choices[0].text
    finally:
        restarted.stop()


ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Router:
    """`vllm-router` on a free port in front of `servers`; stopped by PID."""

    def __init__(self, tmp_path: Path, policy: str, servers: list[ServerProcess], events: list[str]) -> None:
        binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        if not Path(binary).exists():
            pytest.skip("vllm-router is not installed (pip install vllm-router)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"router-{self.port}.log"
        cmd = [binary, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy, "--worker-urls",
               *[s.url for s in servers], "--log-level", "debug", "--prometheus-port", str(free_port()),
               "--disable-retries"]
        if policy == "kv_aware":
            cmd += ["--kv-event-model", "shakespeare", "--kv-event-block-size", "16"]
            for server, endpoint in zip(servers, events):
                cmd += ["--kv-event-source", f"{server.url}={endpoint}"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if not wait_healthy(self.url, self.proc, WAIT_S, "vllm-router", self.log):
            self.stop()
            raise AssertionError(f"vllm-router did not start:\n{self.log()}")

    def log(self) -> str:
        return ANSI.sub("", self.log_path.read_text(errors="replace"))

    def wait_seq(self, worker: str, seq: int) -> None:
        """Until the router logs that it has applied `worker`'s event batch `seq` (its own record)."""
        deadline = time.monotonic() + WAIT_S
        pattern = re.compile(rf"sequence advanced source={re.escape(worker)} rank=0 seq=(\d+)")
        while time.monotonic() < deadline:
            if any(int(m) >= seq for m in pattern.findall(self.log())):
                return
            time.sleep(0.1)
        raise AssertionError(f"the router never applied batch {seq} of {worker}:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_vllm_router_kv_aware_sends_a_shared_prefix_to_the_instance_that_holds_it(tmp_path):
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    servers = [serve(tmp_path, "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": e, "topic": ""})) for e in endpoints]
    router = None
    try:
        router = Router(tmp_path, "kv_aware", servers, endpoints)
        front = ServerProcess.__new__(ServerProcess)
        front.url, front.model = router.url, "shakespeare"
        prompts = [TEXT + f"\n{i}. Exeunt." for i in range(6)]
        first = complete(front, prompts[0], max_tokens=4)
        holder = next(s for s in servers if s.metrics()["kvlab:prompt_tokens_total"] > 0)
        batches = wait_metric(holder, "kvlab:kv_events_batches_total",
                              lambda v: v >= 1 and holder.metrics()["kvlab:kv_events_sent_total"]
                              == holder.metrics()["kvlab:kv_events_queued_total"])
        router.wait_seq(holder.url, int(batches) - 1)
        cached = [complete(front, p, max_tokens=4).usage.prompt_tokens_details.cached_tokens for p in prompts[1:]]
        other = next(s for s in servers if s is not holder)
        assert other.metrics()["kvlab:prompt_tokens_total"] == 0  # nothing went elsewhere
        # what one instance holding every earlier prompt would reuse: every row of the longest common prefix
        # (its prefix cache is token-granular; the router routes by the whole blocks the events announce)
        ids = [holder.post("/tokenize", {"model": "shakespeare", "prompt": p}).json()["tokens"] for p in prompts]
        expected = [min(len(ids[i]) - 1, max(common_prefix(ids[i], ids[j]) for j in range(i)))
                    for i in range(1, len(ids))]
        assert cached == expected and min(expected) >= 0.9 * first.usage.prompt_tokens - 16
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()


@pytest.mark.parametrize("flags, message", [
    (["--kv-tier", "s3://bucket"], "unknown scheme 's3'"),
    (["--kv-tier", "redis://127.0.0.1:1/0?ttl=soon"], "is not a number"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://192.0.2.1:9"}'], "cannot bind"),
    (["--kv-events-config", "{oops"], "not JSON"),
    (["--no-enable-prefix-caching", "--kv-tier", "file:///tmp/kvlab-never"], "need prefix caching"),
])
def test_bad_scale_out_flags_stop_the_server_with_a_clear_error(flags, message):
    proc = subprocess.run([sys.executable, "-m", "kvlab", "serve", "--port", str(free_port()), *flags],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
