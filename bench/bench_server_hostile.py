"""`kvlab serve` while one client is hostile (issue 22 items 2-4): how long /health and a normal request
take while the hostile request is in flight, next to the same with no hostile traffic.

Scenarios, each on the same server (the default model, default limits):
  baseline          nothing hostile
  10 MB body        a 10 MB prompt: refused with 413 while it is read (was: 9.5 s to refuse, /health 7.8 s)
  2 MB tokenize     a 2 MB text to /tokenize, under the 4 MiB limit: tokenized in a worker thread that
                    releases the GIL, so /health should not wait for it
  2 MB prompt       the same text as a completion prompt: refused before tokenizing (it cannot fit)
  1M stop ids       1,000,000 stop_token_ids (6 MB): 413 (was: a normal request 0.046 -> 1.31 s)
  300K stop ids     1.8 MB, under the byte limit: 400 naming the cap of 256
  step fault        (in process) a request whose engine step raises while 4 streams run: only it fails

/health is polled every 10 ms from a thread while the hostile request runs; a normal greedy completion
(16 tokens) starts 50 ms after it. Clients share the CPU with the server, and the machine may be shared:
compare rows of one run, not runs.

    python bench/bench_server_hostile.py      # writes bench/out/bench_server_hostile.json, table to stderr
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import InProcessServer, ServerProcess  # noqa: E402

NORMAL = {"prompt": "Now is the winter of our discontent", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def measure(url: str, hostile: Callable[[], int] | None) -> dict[str, Any]:
    """Run `hostile` (returns its status) while polling /health and timing one normal request."""
    health: list[float] = []
    done = threading.Event()
    result: dict[str, Any] = {}

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.get(f"{url}/health")
                health.append(time.perf_counter() - start)
                time.sleep(0.01)

    def normal() -> None:
        time.sleep(0.05)
        start = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=120)
        result["normal_s"] = time.perf_counter() - start
        result["normal_status"] = response.status_code

    poller, other = threading.Thread(target=poll), threading.Thread(target=normal)
    poller.start()
    other.start()
    start = time.perf_counter()
    result["hostile_status"] = hostile() if hostile is not None else None
    result["hostile_s"] = time.perf_counter() - start
    other.join()
    done.set()
    poller.join()
    result["health_max_s"] = max(health)
    result["health_median_s"] = statistics.median(health)
    result["health_polls"] = len(health)
    return result


def post(url: str, path: str, body: Any) -> Callable[[], int]:
    raw = json.dumps(body).encode()
    return lambda: httpx.post(f"{url}{path}", content=raw, timeout=120,
                              headers={"content-type": "application/json"}).status_code


def fault_scenario() -> dict[str, Any]:
    """In process: a poisoned request joins four running streams and its step raises."""
    import numpy as np

    import kvlab
    from kvlab.model.llama import LlamaModel
    from kvlab.engine.engine import Engine
    from kvlab.serve.app import create_app

    model, tokenizer = kvlab.load()
    poison = 4095
    real = LlamaModel.forward_batch

    def faulty(model, batch, *args, **kwargs):
        if poison in np.asarray(batch.token_ids).tolist():
            raise RuntimeError("injected fault")
        return real(model, batch, *args, **kwargs)

    LlamaModel.forward_batch = faulty
    server = InProcessServer(create_app(Engine(model, tokenizer), tokenizer, model_names=["bard"]))
    try:
        streams = [threading.Thread(target=lambda: httpx.post(
            f"{server.url}/v1/completions", json={**NORMAL, "max_tokens": 64}, timeout=120)) for _ in range(4)]
        for t in streams:
            t.start()
        row = measure(server.url, post(server.url, "/v1/completions", {"prompt": [5, 6, poison], "max_tokens": 4}))
        for t in streams:
            t.join()
        return row
    finally:
        LlamaModel.forward_batch = real
        server.stop()


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    text = ("Now is the winter of our discontent made glorious summer by this sun of York. " * 30000)[:2_000_000]
    rows: dict[str, dict[str, Any]] = {}
    server = ServerProcess(log_dir=OUT)
    try:
        url = server.url
        httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=120)   # warm up (kernels compile once)
        rows["baseline"] = measure(url, None)
        rows["10 MB body"] = measure(url, post(url, "/v1/completions", {"prompt": "x" * 10_000_000}))
        rows["2 MB tokenize"] = measure(url, post(url, "/tokenize", {"prompt": text}))
        rows["2 MB prompt"] = measure(url, post(url, "/v1/completions", {"prompt": text, "max_tokens": 1}))
        for name, count in (("1M stop ids", 1_000_000), ("300K stop ids", 300_000)):
            rows[name] = measure(url, post(url, "/v1/completions", {**NORMAL, "stop_token_ids": [4000] * count}))
    finally:
        server.stop()
    rows["step fault"] = fault_scenario()
    (OUT / "bench_server_hostile.json").write_text(json.dumps(rows, indent=1))
    print(f"{'scenario':<15} {'hostile':>8} {'took s':>7} {'/health max s':>14} {'median s':>9} "
          f"{'normal s':>9} {'normal':>7}", file=sys.stderr)
    for name, r in rows.items():
        print(f"{name:<15} {str(r['hostile_status']):>8} {r['hostile_s']:>7.3f} {r['health_max_s']:>14.3f} "
              f"{r['health_median_s']:>9.4f} {r['normal_s']:>9.3f} {r['normal_status']:>7}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
