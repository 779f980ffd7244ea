"""Decode per byte read, new family against Llama: kvlab and llama.cpp on the same GGUF files, side by side.

Issue 34's goal: decode on the new families as fast as on Llama per byte read. The files (bench/make_1b_gguf.py
--via converter: transformers' `save_pretrained`, llama.cpp's `convert_hf_to_gguf.py`, `llama-quantize`) are
a Qwen3-0.6B-shaped model and a Llama of the very same matrices (qwen3-0.6b without its q/k norms: same
bytes, same K/V per token), each in F16 and Q8_0, so a difference in speed per byte is the architecture's
alone. Per file and context (128, 1024 cached tokens), round by round so drift on a shared machine hits all:

  * kvlab with default flags (`kvlab.load(path)`: weights as the file stores them, block types with int8
    activations since they became the default; the README's family table predates that), the median of `--steps`
    greedy decode steps after a cache of `context` random K/V rows (no prefill: a 1024-token prefill of the
    F16 file costs a minute at 2 threads, far more than the decode timed);
  * llama.cpp's own `llama-bench` on the same file and threads (tg`--steps` at depth = context; the best
    repetition), when found (--llama-bench PATH, $LLAMA_BENCH, PATH).

Reported: tokens/s; GB/s read = the file's weight bytes one decode step reads (every matrix once; the tied
embedding whole, as the LM head: llama_cpp_peer.decode_weight_bytes, the same numerator for both engines;
K/V left out, said beside) x tokens/s; kvlab / llama.cpp; and per engine the family's GB/s over the
baseline's at the same type and context (1.00: as fast per byte as Llama). "fused" says how many of
kvlab's layers take the fused decode kernels (model/ops.py `bind`); the others go step by step.

    python bench/bench_family_decode.py --dir /work/models   # qwen3-0.6b-{F16,Q8_0}.gguf, llama-0.6b-{F16,Q8_0}.gguf
        [--file qwen3-0.6b/F16=PATH ...] [--baseline llama-0.6b] [--llama-bench PATH] [--no-llama-cpp]
        [--threads 2] [--contexts 128 1024] [--steps 32] [--repeats 2] [--llama-repetitions 2]

Writes bench/out/bench_family_decode.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.environ.get("KVLAB_GGUF_DIR"),
                   help="folder holding FAMILY-TYPE.gguf for each --families and --types")
    p.add_argument("--families", nargs="+", default=["qwen3-0.6b", "llama-0.6b"])
    p.add_argument("--types", nargs="+", default=["F16", "Q8_0"])
    p.add_argument("--file", action="append", default=[], metavar="FAMILY/TYPE=PATH",
                   help="one file (repeatable; wins over --dir)")
    p.add_argument("--baseline", default="llama-0.6b", help="the family the others are compared with")
    p.add_argument("--llama-bench", default=None, help="llama-bench binary (default $LLAMA_BENCH, then PATH)")
    p.add_argument("--no-llama-cpp", action="store_true", help="kvlab only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per file, context and engine")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds; the best is reported")
    p.add_argument("--llama-repetitions", type=int, default=2, help="llama-bench -r per round")
    p.add_argument("--out", default=str(OUT))
    return p.parse_args(argv)


def chosen_files(args: argparse.Namespace) -> dict[tuple[str, str], Path]:
    """{(family, type): file} from --file pairs, then FAMILY-TYPE.gguf in --dir; missing files are refused."""
    files: dict[tuple[str, str], Path] = {}
    for pair in args.file:
        label, sep, path = pair.partition("=")
        family, slash, kind = label.rpartition("/")
        if not sep or not slash or not path:
            raise SystemExit(f"--file {pair!r}: expected FAMILY/TYPE=PATH")
        files[(family, kind.upper())] = Path(path)
    if args.dir is not None:
        for family in args.families:
            for kind in args.types:
                files.setdefault((family, kind.upper()), Path(args.dir) / f"{family}-{kind.upper()}.gguf")
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing or not files:
        raise SystemExit(f"no such GGUF file: {', '.join(missing)}" if missing else "give --dir or --file")
    return files


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # thread counts before NumPy (OpenBLAS) and numba start their pools
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvlab, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_peer  # noqa: E402 (bench/llama_cpp_peer.py)
from bench_gguf_peer import peer_env  # noqa: E402 (llama.cpp without kvlab's OpenMP wait policy)
from kvlab_timing import decode_step_times  # noqa: E402 (bench/kvlab_timing.py)
from kvlab.progress import KernelCompiles, compiling_kernels  # noqa: E402


def filled_cache(model, context: int, steps: int, seed: int = 0):
    """A cache holding `context` random K/V rows at positions 0..context-1, room for `steps` more: decode
    reads them as it reads a prefill's (the values do not change the work)."""
    spec, rng = model.cache_spec, np.random.default_rng(seed)
    cache = model.new_cache(1, capacity=context + steps + 1)
    shape = (1, spec.num_kv_heads, context, spec.head_dim)
    for layer in range(spec.num_layers):
        keys, values = (rng.standard_normal(shape, dtype=np.float32).astype(model.dtype) for _ in range(2))
        cache.update(layer, keys, values, np.arange(context))
    cache.commit(context)
    return cache


def decode_seconds(model, context: int, steps: int) -> float:
    """Median seconds of one greedy decode step after `context` cached tokens (compiles taken out)."""
    cache = filled_cache(model, context, steps)
    with KernelCompiles() as compiles:
        return statistics.median(decode_step_times(model, cache, np.array([[300]]), steps, compiles))


def fused_layers(model) -> int:
    """How many layers the compiled ops bind to the fused decode kernels (the rest go step by step)."""
    if not model.ops.compiled:
        return 0
    return sum(bound is not layer for bound, layer in zip(model.ops.bind(model.layers), model.layers))


def main() -> None:
    import kvlab

    files = chosen_files(ARGS)
    bench_bin = None if ARGS.no_llama_cpp else llama_cpp_peer.find_llama_bench(ARGS.llama_bench)
    peer = "skipped (--no-llama-cpp)" if ARGS.no_llama_cpp else \
        f"llama-bench {bench_bin}" if bench_bin else "no llama-bench (--llama-bench PATH or $LLAMA_BENCH): skipped"
    print(f"llama.cpp: {peer}", file=sys.stderr)
    env = peer_env(bench_bin.parent if bench_bin is not None else None)
    models, info = {}, {}
    for key, path in files.items():
        models[key] = kvlab.load(path)[0]
        c = models[key].config
        info[key] = {"file": str(path), "file_bytes": path.stat().st_size,
                     "weight_bytes": llama_cpp_peer.decode_weight_bytes(llama_cpp_peer.gguf_tensors(path)),
                     "architecture": c.architecture, "layers": c.num_hidden_layers,
                     "fused_layers": fused_layers(models[key]),
                     "kv_bytes_per_token_f16": llama_cpp_peer.kv_bytes(c.num_hidden_layers, c.num_key_value_heads,
                                                                       c.head_dim, 1)}
        with compiling_kernels():
            models[key].warm_up()
        print(f"loaded {key[0]} {key[1]}: {path} ({info[key]['fused_layers']}/{c.num_hidden_layers} layers fused)",
              file=sys.stderr)
    best: dict[tuple[str, str, int, str], float] = {}  # (family, type, context, engine) -> seconds per token
    for round_number in range(ARGS.repeats):
        for context in ARGS.contexts:
            for key, path in files.items():
                times = {"kvlab": decode_seconds(models[key], context, ARGS.steps)}
                if bench_bin is not None:
                    (tg,) = llama_cpp_peer.run_llama_bench(bench_bin, path, ARGS.threads, env, gen=ARGS.steps,
                                                           depths=[context], repetitions=ARGS.llama_repetitions)
                    times["llama.cpp"] = 1.0 / tg.best_tokens_per_s
                for engine, seconds in times.items():
                    slot = (*key, context, engine)
                    best[slot] = min(best.get(slot, float("inf")), seconds)
        print(f"round {round_number + 1}/{ARGS.repeats} done", file=sys.stderr)
    report = build_report(files, info, best)
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_family_decode.json").write_text(json.dumps(report, indent=2))
    markdown = render_markdown(report)
    (out / "bench_family_decode.md").write_text(markdown)
    print(markdown)


def build_report(files: dict, info: dict, best: dict) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    rows = []
    for (family, kind), path in files.items():
        for context in ARGS.contexts:
            row = {"family": family, "type": kind, "context": context, **info[(family, kind)]}
            for engine in ("kvlab", "llama.cpp"):
                seconds = best.get((family, kind, context, engine))
                if seconds is not None:
                    row[engine] = {"step_s": seconds, "tokens_per_s": 1 / seconds,
                                   "weight_gb_per_s": row["weight_bytes"] / seconds / 1e9}
            rows.append(row)
    by_key = {(r["family"], r["type"], r["context"]): r for r in rows}
    per_byte = []
    for r in rows:
        base = by_key.get((ARGS.baseline, r["type"], r["context"]))
        if r["family"] == ARGS.baseline or base is None:
            continue
        per_byte.append({"family": r["family"], "type": r["type"], "context": r["context"], **{
            engine: r[engine]["weight_gb_per_s"] / base[engine]["weight_gb_per_s"]
            for engine in ("kvlab", "llama.cpp") if engine in r and engine in base}})
    return {"cpu": cpu, "threads": ARGS.threads, "steps": ARGS.steps, "repeats": ARGS.repeats,
            "load_average": os.getloadavg(), "baseline": ARGS.baseline, "decode": rows,
            "per_byte_vs_baseline": per_byte}


def render_markdown(report: dict) -> str:
    def cell(row: dict, engine: str) -> str:
        r = row.get(engine)
        return f"{r['tokens_per_s']:.1f} ({r['weight_gb_per_s']:.2f} GB/s)" if r else "-"

    lines = [f"{report['cpu']}, {report['threads']} threads, load average {report['load_average'][0]:.1f} at the "
             f"end; median of {report['steps']} steps (kvlab) / best llama-bench repetition, best of "
             f"{report['repeats']} rounds.", "",
             "Decode tokens/s (GB/s of weights read: the file's bytes one step reads x tokens/s):", "",
             "| family | type | weight MB | fused layers | context | kvlab | llama.cpp | kvlab / llama.cpp |",
             "|---|---|---:|---|---:|---|---|---:|"]
    for r in report["decode"]:
        ratio = f"{r['kvlab']['tokens_per_s'] / r['llama.cpp']['tokens_per_s']:.2f}" \
            if "kvlab" in r and "llama.cpp" in r else "-"
        lines.append(f"| {r['family']} | {r['type']} | {r['weight_bytes'] / 1e6:.0f} | {r['fused_layers']}/"
                     f"{r['layers']} | {r['context']} | {cell(r, 'kvlab')} | {cell(r, 'llama.cpp')} | {ratio} |")
    lines += ["", f"Per byte read, each family's GB/s over {report['baseline']}'s (same type and context; 1.00: as "
              "fast per byte as Llama):", "", "| family | type | context | kvlab | llama.cpp |",
              "|---|---|---:|---:|---:|"]
    for r in report["per_byte_vs_baseline"]:
        cells = [f"{r[e]:.2f}" if e in r else "-" for e in ("kvlab", "llama.cpp")]
        lines.append(f"| {r['family']} | {r['type']} | {r['context']} | {' | '.join(cells)} |")
    kv = {r["family"]: r["kv_bytes_per_token_f16"] for r in report["decode"]}
    lines += ["", "K/V read per cached token (f16; kvlab keeps float32, twice that), not in the GB/s: "
              + ", ".join(f"{family} {b / 1e3:.0f} kB" for family, b in kv.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
