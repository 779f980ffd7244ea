"""`kvlab serve` under load: N concurrent streaming clients that share a system prompt, with and without
prefix caching, side by side in one run.

Each of --clients clients sends --requests requests one after another over HTTP (SSE streaming, greedy,
--max-tokens tokens each, EOS ignored): the shared system prompt (--prefix-tokens tokens cut from the
default model's validation text) plus a question of its own (--question-tokens). Two server subprocesses on
the default model run the same workload in turn, one with `--enable-prefix-caching`, one with
`--no-enable-prefix-caching`. Reported per server: requests/s, TTFT and inter-token latency percentiles (as
the client sees them), the prefix-cache hit rate (from /metrics) and the cached tokens the responses
reported. The clients run in this process (asyncio + httpx), so they share the CPU with the server: only
the ratios between the two servers mean anything, and the machine may be shared with other work.

    python bench/bench_server.py [--clients 8] [--requests 4] [--prefix-tokens 160] [--threads 1]

Writes bench/out/bench_server.json; a table goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import ServerProcess  # noqa: E402  (the tests' server runner: free port, health, PID)


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """One prompt per request: the shared prefix, then a question cut from elsewhere in the text."""
    from kvlab.hf.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    ids = tokenizer.encode((resolve_model_dir(None) / "validation.txt").read_text(encoding="utf-8"))
    prefix = ids[:args.prefix_tokens]
    total = args.clients * args.requests
    step = (len(ids) - args.prefix_tokens - args.question_tokens) // total
    return [prefix + ids[args.prefix_tokens + i * step:args.prefix_tokens + i * step + args.question_tokens]
            for i in range(total)]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {"ttft": times[0] - start, "itl": [b - a for a, b in zip(times, times[1:])],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "prompt": usage["prompt_tokens"]}


async def workload(url: str, all_prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def user(c: int) -> list[dict]:
            return [await one_request(client, url, all_prompts[c * args.requests + r], args.max_tokens)
                    for r in range(args.requests)]

        start = time.perf_counter()
        per_user = await asyncio.gather(*(user(c) for c in range(args.clients)))
        return [r for rs in per_user for r in rs], time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run_server(caching: bool, all_prompts: list[list[int]], args: argparse.Namespace) -> dict:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    env = {"OPENBLAS_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    server = ServerProcess(flag, "--max-num-seqs", str(args.clients), log_dir=OUT, env=env)
    try:
        warm = [all_prompts[0][:8]]   # first request pays for imports/allocation: not measured
        asyncio.run(workload(server.url, warm, argparse.Namespace(**{**vars(args), "clients": 1, "requests": 1})))
        before = server.metrics()
        results, wall = asyncio.run(workload(server.url, all_prompts, args))
        after = server.metrics()
        server.wait_idle()
    finally:
        server.stop()
    queries = after["kvlab:prefix_cache_queries_total"] - before["kvlab:prefix_cache_queries_total"]
    hits = after["kvlab:prefix_cache_hits_total"] - before["kvlab:prefix_cache_hits_total"]
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    return {"prefix_caching": caching, "requests": len(results), "wall_s": wall,
            "requests_per_s": len(results) / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p90_ms": 1e3 * percentile(ttft, 90),
            "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p90_ms": 1e3 * percentile(itl, 90),
            "itl_p99_ms": 1e3 * percentile(itl, 99),
            "hit_rate": hits / queries if queries else 0.0,
            "cached_tokens_reported": sum(r["cached"] for r in results),
            "prompt_tokens": sum(r["prompt"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    parser.add_argument("--prefix-tokens", type=int, default=160)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads in the server (default 1)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    all_prompts = prompts(args)
    rows = [run_server(caching, all_prompts, args) for caching in (False, True)]
    off, on = rows
    ratios = {"requests_per_s_on_over_off": on["requests_per_s"] / off["requests_per_s"],
              "ttft_p50_off_over_on": off["ttft_p50_ms"] / on["ttft_p50_ms"]}
    report = {"clients": args.clients, "requests_per_client": args.requests, "prefix_tokens": args.prefix_tokens,
              "question_tokens": args.question_tokens, "max_tokens": args.max_tokens, "threads": args.threads,
              "cpu_count": os.cpu_count(), "rows": rows, "ratios": ratios}
    (OUT / "bench_server.json").write_text(json.dumps(report, indent=2))

    from rich.table import Table

    from kvlab.cli.fmt import console

    table = Table(title=f"kvlab serve: {args.clients} clients x {args.requests} requests, shared "
                        f"{args.prefix_tokens}-token prefix + {args.question_tokens}, {args.max_tokens} tokens each")
    for col in ("prefix caching", "req/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "hit rate",
                "cached tokens"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row("on" if r["prefix_caching"] else "off", f"{r['requests_per_s']:.2f}",
                      f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                      f"{r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} / {r['itl_p99_ms']:.1f}",
                      f"{100 * r['hit_rate']:.1f}%", f"{r['cached_tokens_reported']} / {r['prompt_tokens']}")
    con = console(stderr=True)
    con.print(table)
    con.print(f"prefix caching: {ratios['requests_per_s_on_over_off']:.2f}x requests/s, TTFT p50 "
              f"{ratios['ttft_p50_off_over_on']:.2f}x lower (same run, {os.cpu_count()} CPUs, machine may be "
              f"shared); numbers in {OUT / 'bench_server.json'}")


if __name__ == "__main__":
    main()
