"""The paged engine under load: batching, the prefix cache and paged memory, ratios side by side in one run.

On the default model (`kvlab.load()`: 4 layers, hidden 256, 8/2 query/KV heads, 256-token context,
float32), four measurements:

  1. decode throughput at batch 1/4/16/64: B requests (16-token prompts, 64 greedy tokens each) run
     together by one Engine, against the same requests run one after another (the same Engine at batch
     1), and against the plain `kvlab.generate` loop one request at a time; best of --repeat, alternated;
  2. a shared-system-prompt workload: 32 requests with a common 192-token prefix and their own 16-token
     question, arriving one per step (continuous batching), 16 tokens each, with and without prefix
     caching: time to first token (from add_request to the step that returns it), prefix-cache hit rate,
     and prefill tokens the model computed;
  3. concurrency at a fixed KV budget (--kv-budget, default 4 MiB): 64 requests of 16 + 48 tokens run by
     an Engine with that budget; its peak number of running sequences against what the same bytes hold
     when every sequence preallocates the full context (the contiguous-cache way), and the time of both
     (the latter is an Engine capped at that many sequences);
  4. K/V memory wasted per running sequence, averaged over the run's steps: paging (allocated slots -
     stored tokens, < 1 block) vs preallocation (context - stored tokens).

A rich table goes to stderr; the numbers to bench/out/bench_engine.json and a plot to
bench/out/bench_engine.png. One OpenBLAS thread by default. The machine may be shared: only the ratios
within one run mean anything.

    python bench/bench_engine.py [--repeat 2] [--threads 1] [--kv-budget 4MiB] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def prompt_pool(tokenizer, vocab: int, count: int, length: int, rng) -> list[list[int]]:
    """`count` prompts of `length` tokens cut from the model's validation text (random ids if too short)."""
    text_file = Path(__file__).resolve().parents[1] / "kvlab" / "models" / "shakespeare" / "validation.txt"
    ids = tokenizer.encode(text_file.read_text(encoding="utf-8")) if text_file.is_file() else []
    if len(ids) < count * length:
        return [rng.integers(2, vocab, length).tolist() for _ in range(count)]
    starts = rng.choice(len(ids) // length, count, replace=False) * length
    return [list(ids[s:s + length]) for s in starts]


def decode_throughput(model, tokenizer, batches, new_tokens, repeat, rng):
    from kvlab import Engine, SamplingParams, generate

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = prompt_pool(tokenizer, model.config.vocab_size, batch, 16, rng)
        best = {"batched": float("inf"), "one_by_one": float("inf"), "plain": float("inf")}
        for _ in range(repeat):
            engine = Engine(model, max_num_seqs=max(batches))
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            best["batched"] = min(best["batched"], time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
            engine = Engine(model, max_num_seqs=max(batches))
            start = time.perf_counter()
            for p in prompts:
                engine.generate([p], params)
            best["one_by_one"] = min(best["one_by_one"], time.perf_counter() - start)
            start = time.perf_counter()
            for p in prompts:
                generate(model, [p], new_tokens)
            best["plain"] = min(best["plain"], time.perf_counter() - start)
        tokens = batch * new_tokens
        rows.append({"batch": batch, **{f"{k}_tok_s": tokens / v for k, v in best.items()},
                     "speedup_vs_one_by_one": best["one_by_one"] / best["batched"],
                     "speedup_vs_plain": best["plain"] / best["batched"]})
    return rows


def shared_prefix(model, tokenizer, num_requests, prefix_len, question_len, new_tokens, rng):
    from kvlab import Engine, SamplingParams

    system = prompt_pool(tokenizer, model.config.vocab_size, 1, prefix_len, rng)[0]
    questions = prompt_pool(tokenizer, model.config.vocab_size, num_requests, question_len, rng)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    result, tokens = {}, {}
    for caching in (False, True):
        engine = Engine(model, enable_prefix_caching=caching, max_num_seqs=num_requests)
        added, ttft, finals = {}, {}, {}
        start = time.perf_counter()
        for i in range(num_requests + 10_000):
            if i < num_requests:
                engine.add_request(f"q{i}", system + questions[i], params)
                added[f"q{i}"] = time.perf_counter()
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = time.perf_counter() - added[out.request_id]
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
        wall = time.perf_counter() - start
        stats = engine.stats()
        key = "cached" if caching else "uncached"
        tokens[key] = finals
        result[key] = {"ttft_mean_ms": 1e3 * statistics.mean(ttft.values()),
                       "ttft_p50_ms": 1e3 * statistics.median(ttft.values()),
                       "prefill_tokens": stats["num_prefill_tokens"],
                       "hit_rate": stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1),
                       "wall_s": wall}
    result["same_tokens"] = tokens["cached"] == tokens["uncached"]
    result["num_requests"], result["prefix_len"] = num_requests, prefix_len
    result["prefill_reduction"] = result["uncached"]["prefill_tokens"] / result["cached"]["prefill_tokens"]
    result["ttft_speedup"] = result["uncached"]["ttft_mean_ms"] / result["cached"]["ttft_mean_ms"]
    return result


def concurrency(model, tokenizer, budget_text, num_requests, prompt_len, new_tokens, rng):
    from kvlab import Engine, SamplingParams
    from kvlab.cache.memory import parse_bytes

    budget = parse_bytes(budget_text)
    config = model.config
    context = config.max_position_embeddings
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim \
        * model.dtype.itemsize
    prealloc_seqs = budget // (context * bytes_per_token)
    prompts = prompt_pool(tokenizer, config.vocab_size, num_requests, prompt_len, rng)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    runs = {}
    for name, max_seqs in (("paged", num_requests), ("preallocated", max(prealloc_seqs, 1))):
        engine = Engine(model, kv_cache_memory=budget, max_num_seqs=max_seqs)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        peak, seq_steps, stored, waste, steps = 0, 0, 0, 0, 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            running = engine.scheduler.running
            peak = max(peak, len(running))
            seq_steps += len(running)  # averaged over every step and running sequence:
            stored += sum(s.num_computed_tokens for s in running)
            waste += sum(len(s.block_table) * engine.block_pool.block_size - s.num_computed_tokens
                         for s in running)
        runs[name] = {"peak_running": peak, "wall_s": time.perf_counter() - start,
                      "mean_running": seq_steps / max(steps, 1),
                      "preemptions": engine.stats()["num_preemptions"],
                      "waste_tokens_per_seq": waste / max(seq_steps, 1),
                      "stored_tokens_per_seq": stored / max(seq_steps, 1)}
    stored = runs["paged"]["stored_tokens_per_seq"]
    return {"budget_bytes": budget, "bytes_per_token": bytes_per_token, "context": context,
            "block_size": 16, "prealloc_capacity_seqs": int(prealloc_seqs),
            "paged_peak_running": runs["paged"]["peak_running"],
            "paged_mean_running": runs["paged"]["mean_running"],
            "prealloc_mean_running": runs["preallocated"]["mean_running"],
            "concurrency_ratio": runs["paged"]["peak_running"] / max(prealloc_seqs, 1),
            "paged_wall_s": runs["paged"]["wall_s"], "prealloc_wall_s": runs["preallocated"]["wall_s"],
            "throughput_ratio": runs["preallocated"]["wall_s"] / runs["paged"]["wall_s"],
            "paged_preemptions": runs["paged"]["preemptions"],
            "paged_waste_tokens_per_seq": runs["paged"]["waste_tokens_per_seq"],
            "stored_tokens_per_seq": stored,
            "prealloc_waste_tokens_per_seq": context - stored}


def plot(results, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rows = results["decode"]
    batches = [r["batch"] for r in rows]
    for key, label in (("batched_tok_s", "Engine, batched"), ("one_by_one_tok_s", "Engine, one after another"),
                       ("plain_tok_s", "kvlab.generate, one after another")):
        axes[0].plot(batches, [r[key] for r in rows], marker="o", label=label)
    axes[0].set(xscale="log", xlabel="requests (batch)", ylabel="generated tokens / s",
                title="decode throughput")
    axes[0].set_xticks(batches, [str(b) for b in batches])
    axes[0].minorticks_off()
    axes[0].legend(fontsize=8)
    shared = results["shared_prefix"]
    names = ["no prefix cache", "prefix cache"]
    ttft = [shared["uncached"]["ttft_mean_ms"], shared["cached"]["ttft_mean_ms"]]
    prefill = [shared["uncached"]["prefill_tokens"], shared["cached"]["prefill_tokens"]]
    axes[1].bar(names, prefill, color=["tab:gray", "tab:green"])
    axes[1].set(ylabel="prefill tokens computed", ylim=(0, 1.25 * max(prefill)),
                title=f"{shared['num_requests']} requests, shared {shared['prefix_len']}-token prefix")
    for i, (p, t) in enumerate(zip(prefill, ttft)):
        axes[1].annotate(f"{p:,} tokens\nTTFT {t:.0f} ms", (i, p), ha="center", va="bottom", fontsize=8)
    conc = results["concurrency"]
    axes[2].bar(["preallocated\n(full context)", "paged"],
                [conc["prealloc_mean_running"], conc["paged_mean_running"]], color=["tab:gray", "tab:blue"])
    axes[2].set(ylabel="sequences running at once (mean over steps)",
                title=f"fixed KV budget {conc['budget_bytes'] / 2**20:.0f} MiB")
    for i, w in enumerate([conc["prealloc_waste_tokens_per_seq"], conc["paged_waste_tokens_per_seq"]]):
        axes[2].annotate(f"waste {w:.1f} tokens/seq", (i, 0), ha="center", va="bottom", fontsize=8)
    fig.suptitle("kvlab Engine on the default model (ratios from one run; the machine may be shared)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-budget", "--kv_budget", default="4MiB")
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))

    import numpy as np
    from rich.table import Table

    import kvlab
    from kvlab.cli.fmt import console

    con = console(stderr=True)
    model, tokenizer = kvlab.load()
    rng = np.random.default_rng(0)
    batches = [1, 4] if args.quick else [1, 4, 16, 64]
    new_tokens = 8 if args.quick else 64
    con.print(f"default model, float32, OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}; "
              "ratios are side by side in this run (the machine may be shared)")
    results = {"decode": decode_throughput(model, tokenizer, batches, new_tokens, args.repeat, rng)}
    n_shared = 8 if args.quick else 32
    results["shared_prefix"] = shared_prefix(model, tokenizer, n_shared, 192, 16, 4 if args.quick else 16, rng)
    results["concurrency"] = concurrency(model, tokenizer, args.kv_budget, 16 if args.quick else 64, 16,
                                         8 if args.quick else 48, rng)

    table = Table(title="decode throughput (generated tokens/s)")
    for col in ("batch", "batched", "one by one", "generate() one by one", "vs one by one",
                "vs generate()"):
        table.add_column(col, justify="right")
    for r in results["decode"]:
        table.add_row(str(r["batch"]), f"{r['batched_tok_s']:,.0f}", f"{r['one_by_one_tok_s']:,.0f}",
                      f"{r['plain_tok_s']:,.0f}", f"{r['speedup_vs_one_by_one']:.1f}x",
                      f"{r['speedup_vs_plain']:.1f}x")
    con.print(table)
    batch1 = results["decode"][0]["batched_tok_s"]
    for r in results["decode"]:
        r["vs_batch1"] = r["batched_tok_s"] / batch1

    s = results["shared_prefix"]
    table = Table(title=f"shared system prompt: {n_shared} requests, 192-token common prefix, one new per step")
    for col in ("", "TTFT mean ms", "TTFT p50 ms", "prefill tokens", "hit rate", "wall s"):
        table.add_column(col, justify="right")
    for key in ("uncached", "cached"):
        v = s[key]
        table.add_row("prefix cache" if key == "cached" else "no prefix cache", f"{v['ttft_mean_ms']:.1f}",
                      f"{v['ttft_p50_ms']:.1f}", f"{v['prefill_tokens']:,}", f"{v['hit_rate']:.0%}",
                      f"{v['wall_s']:.2f}")
    con.print(table)
    con.print(f"prefill work drops {s['prefill_reduction']:.1f}x, mean TTFT {s['ttft_speedup']:.1f}x; "
              f"same tokens with and without the cache: {s['same_tokens']}")

    c = results["concurrency"]
    table = Table(title=f"fixed KV budget {c['budget_bytes'] / 2**20:.1f} MiB ({c['bytes_per_token']:,} B/token)")
    for col in ("", "peak seqs", "mean seqs", "wasted tokens/seq", "wall s"):
        table.add_column(col, justify="right")
    table.add_row("preallocate the context", str(c["prealloc_capacity_seqs"]),
                  f"{c['prealloc_mean_running']:.1f}",
                  f"{c['prealloc_waste_tokens_per_seq']:.1f}", f"{c['prealloc_wall_s']:.2f}")
    table.add_row("paged (block 16)", str(c["paged_peak_running"]), f"{c['paged_mean_running']:.1f}",
                  f"{c['paged_waste_tokens_per_seq']:.1f}", f"{c['paged_wall_s']:.2f}")
    con.print(table)
    con.print(f"paged runs {c['concurrency_ratio']:.1f}x the sequences at once at its peak, "
              f"{c['paged_mean_running'] / max(c['prealloc_mean_running'], 1e-9):.1f}x on average "
              f"({c['paged_preemptions']} preemptions), {c['throughput_ratio']:.1f}x the throughput")
    d16 = [r for r in results["decode"] if r["batch"] == 16]
    if d16:
        con.print(f"batch-16 decode throughput = {d16[0]['vs_batch1']:.1f}x batch 1 (target >= 4x); "
                  f"shared-prefix prefill work drops {s['prefill_reduction']:.1f}x (target >= 5x)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_engine.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "bench_engine.png")
    con.print(f"wrote {OUT / 'bench_engine.json'} and {OUT / 'bench_engine.png'}")


if __name__ == "__main__":
    main()
