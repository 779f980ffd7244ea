"""kvlab and llama.cpp on the same GGUF files, side by side in one run: decode, prefill, roofline, logits.

For every file (by default F16, Q8_0, Q4_0, Q4_1, Q4_K_M of one model), one file at a time (its models
loaded, run, checked and dropped before the next file loads, so a 1B or 3B model fits; the process's peak
RSS per file is reported), the engines take turns, round by round and context by context, so drift on a
shared machine hits all alike:

  * kvlab with the weights as stored and exact products ("kvlab exact": `kvlab.load(path,
    weights_dtype="stored", activations="float32")`: half or quantized blocks read by whatever kernels this
    checkout has), the same with the quantized products' inputs rounded to int8 as llama.cpp rounds them
    ("kvlab q8": `activations="q8"`, integer dot products; block-type files only; what `kvlab.load(path)`
    and every command run on such a file by default), and dequantized (`weights_dtype="float32"`, the
    reference; `--no-float32` skips it: 4 bytes a weight);
  * llama.cpp's own `llama-bench` on the same file, the same thread count (tg at depth = context, and pp);
    without llama-bench, llama.cpp through llama-cpp-python in a worker process, timed as kvlab is.

Per context (128, 1024, 4096): decode tokens/s (kvlab: median step of the best round; llama.cpp: the best
repetition's mean over `--steps` tokens), and each engine's roofline: the bytes its decode step reads (its
weights as it keeps them, plus its K/V cache at that context: float32 in kvlab, f16 in llama.cpp) over the
streaming-read bandwidth measured in the same run (bench/roofline.py, a parallel sum over 512 MiB).
Prefill: tokens/s of a 128- and a 1024-token prompt from an empty cache (llama.cpp's pp128/pp1024).

Checks printed beside the timings:
  * kvlab exact vs kvlab float32 on each file: max |logit difference| / (max |logit| + 1), 16 tokens;
  * llama.cpp loads each file (and each `--kvlab-files` file, written by `kvlab quantize`) and its logits at
    every position of real text agree with kvlab's float32 logits of the same file: max |difference|,
    relative to max |logit| + 1, and top-1 agreement, against the tolerances printed with them.

llama.cpp is optional: with neither llama-bench nor an importable llama-cpp-python the peer columns are
skipped (a line says why); without llama-cpp-python the logits check is skipped. llama-cpp-python can use
a libllama.so built apart (LLAMA_CPP_LIB_PATH), so its own ~15-minute build is not needed. Paths:

    python bench/bench_gguf_peer.py --dir DIR            # DIR holds *F16.gguf, *Q8_0.gguf, ... (or $KVLAB_GGUF_DIR)
        [--file Q4_1=x.gguf ...] [--kvlab-files DIR_OR_FILES ...] [--llama-bench PATH ($LLAMA_BENCH)]
        [--llama-cpp-lib DIR ($LLAMA_CPP_LIB_PATH; default: llama-bench's folder)]
        [--threads 2] [--contexts 128 1024 4096] [--prefill 128 1024] [--steps 32] [--repeats 2]

Writes bench/out/bench_gguf_peer.json, .md (the tables in Markdown) and .png (decode tok/s per file and
context, rooflines marked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M")
CHECK_TEXT = Path(__file__).resolve().parent.parent / "kvlab" / "models" / "shakespeare" / "validation.txt"
# llama.cpp multiplies quantized weights by activations rounded to 8 bits per block (F16 weights: by
# activations rounded to float16), and caches K/V in float16, so its logits differ from kvlab's exact
# float32 products of the same weights. Measured on SmolLM2-135M-Instruct, 64 tokens of validation.txt
# (this bench, 2026-12-01, llama.cpp of llama-cpp-python 0.3.36): max |difference| / (max |logit| + 1)
# 0.0014 on F16 (max |diff| 0.047), 0.047 on Q8_0 (1.62; the BOS position alone 0.55), 0.044-0.076 on the
# Q4/Q5 types, 0.117 on Q4_K_M (its K blocks take 8-bit activations per 256); top-1 agreement 90.6-100 %.
# The bounds are a few times above that; a file llama.cpp misread (rows out of order, wrong scales) would
# give differences of the order of the logits themselves.
CHECK_RELATIVE = 0.3
ENGINES = ("kvlab exact", "kvlab q8", "kvlab float32", "llama.cpp")
CHECK_TOP1 = 0.8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.environ.get("KVLAB_GGUF_DIR"),
                   help="folder with one *TYPE.gguf per type (default $KVLAB_GGUF_DIR)")
    p.add_argument("--file", action="append", default=[], metavar="TYPE=PATH",
                   help="the file of one type (repeatable; wins over --dir)")
    p.add_argument("--types", nargs="+", default=list(TYPES))
    p.add_argument("--kvlab-files", nargs="*", default=[], metavar="PATH",
                   help="GGUF files written by `kvlab quantize` (or folders of them): llama.cpp must load them")
    p.add_argument("--llama-bench", default=None, help="llama-bench binary (default $LLAMA_BENCH, then PATH)")
    p.add_argument("--llama-cpp-lib", default=os.environ.get("LLAMA_CPP_LIB_PATH"),
                   help="folder with libllama.so for llama-cpp-python (default $LLAMA_CPP_LIB_PATH, "
                        "else llama-bench's folder)")
    p.add_argument("--no-llama-cpp", action="store_true", help="kvlab only")
    p.add_argument("--no-float32", action="store_true",
                   help="skip the dequantized float32 engine (4 bytes a weight: 4.3 GB for a 1B model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 1024],
                   help="prompt lengths whose prefill is reported (each must be one of --contexts)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per context and engine")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds; the best is reported")
    p.add_argument("--check-tokens", type=int, default=64, help="tokens of real text for the logits check")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if not set(args.prefill) <= set(args.contexts):
        p.error(f"--prefill {args.prefill} must be among --contexts {args.contexts}")
    return args


def files_by_type(pairs: list[str], folder: str | None, types: list[str]) -> tuple[dict[str, Path], list[str]]:
    """{type: file} from TYPE=PATH pairs, else the one file in `folder` whose name ends in TYPE.gguf after a
    separator ("-", "_", "." or the start); and a line for each type left out, saying why."""
    chosen: dict[str, Path] = {}
    for pair in pairs:
        kind, sep, path = pair.partition("=")
        if not sep or not path:
            raise SystemExit(f"--file {pair!r}: expected TYPE=PATH")
        chosen[kind.upper()] = Path(path)
    missing = []
    for kind in types:
        if kind.upper() in chosen:
            continue
        if folder is None:
            missing.append(f"{kind}: no --file {kind}=PATH and no --dir")
            continue
        suffix = f"{kind}.gguf".lower()
        found = sorted(f for f in Path(folder).glob("*.gguf") if f.name.lower().endswith(suffix)
                       and (len(f.name) == len(suffix) or f.name[-len(suffix) - 1] in "-_."))
        if len(found) == 1:
            chosen[kind.upper()] = found[0]
        else:
            missing.append(f"{kind}: {len(found)} files in {folder} end in {kind}.gguf" +
                           (f" ({', '.join(f.name for f in found)})" if found else ""))
    absent = [f"{kind}: {path} does not exist" for kind, path in chosen.items() if not path.is_file()]
    return ({k: v for k, v in chosen.items() if v.is_file() and k in [t.upper() for t in types]},
            missing + absent)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # thread counts before NumPy (OpenBLAS) and numba start their pools
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)
OUTSIDE_WAIT_POLICY = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
if ARGS is not None:  # kvlab's defaults (kvlab/kernels/__init__.py, kvlab/__init__.py); llama.cpp keeps its own
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvlab, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_peer  # noqa: E402 (bench/llama_cpp_peer.py)
from kvlab_timing import kvlab_run, step_bytes  # noqa: E402 (bench/kvlab_timing.py)
from kvlab.model.heap import release_free_memory  # noqa: E402
from roofline import measure_bandwidth  # noqa: E402 (bench/roofline.py)


def peer_env(lib_dir: Path | None) -> dict[str, str]:
    """The environment of llama.cpp's processes: ours without the OpenMP wait policy kvlab sets for itself
    (unless it was set outside), and LLAMA_CPP_LIB_PATH for llama-cpp-python."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OUTSIDE_WAIT_POLICY)
    if lib_dir is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    return env


class LlamaBenchPeer:
    """llama.cpp timed by its own llama-bench: tg at depth = context (the depth's prefill untimed), pp from
    an empty cache; the best of 3 repetitions (plus llama-bench's warm-up run)."""

    def __init__(self, binary: Path, env: dict[str, str]) -> None:
        self.binary, self.env = binary, env
        self.cache_types: dict[str, tuple[str, str]] = {}

    def decode(self, kind: str, path: Path, context: int) -> tuple[float, None]:
        (tg,) = llama_cpp_peer.run_llama_bench(self.binary, path, ARGS.threads, self.env, gen=ARGS.steps,
                                               depths=[context], repetitions=3)
        self.cache_types[kind] = (tg.type_k, tg.type_v)
        return 1.0 / tg.best_tokens_per_s, None

    def prefill(self, path: Path) -> dict[int, float]:
        records = llama_cpp_peer.run_llama_bench(self.binary, path, ARGS.threads, self.env, prompts=ARGS.prefill,
                                                 repetitions=3)
        return {r.tokens: r.tokens / r.best_tokens_per_s for r in records}


class WorkerPeer:
    """llama.cpp through llama-cpp-python in a worker process per file (bench/llama_cpp_peer.py), timed as
    kvlab is: a prefill of `context` random ids, then the median of `--steps` one-token decode calls.
    llama-cpp-python's default cache is f16."""

    def __init__(self, files: dict[str, Path], env: dict[str, str]) -> None:
        n_ctx = max(ARGS.contexts) + ARGS.steps + 8
        self.workers = {path: llama_cpp_peer.LlamaCppWorker(path, ARGS.threads, n_ctx, env) for path in files.values()}
        self.cache_types = {kind: ("f16", "f16") for kind in files}

    def decode(self, kind: str, path: Path, context: int) -> tuple[float, float]:
        prefill, decode = self.workers[path].run(context, ARGS.steps)
        return decode, prefill

    def prefill(self, path: Path) -> dict[int, float]:
        return {}  # measured with each context's decode run

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def reset_peak_rss() -> None:
    """Start this process's resident high-water mark afresh (Linux clear_refs 5; elsewhere a no-op)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """This process's resident high-water mark since the last reset (VmHWM), or ru_maxrss off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_logits(label: str, path: Path, models: dict, tokenizer, env: dict[str, str]) -> dict:
    """llama.cpp's logits of the file at every position of real text against kvlab's (float32, else the
    stored weights), and against the int8-activation mode where it ran."""
    text_ids = tokenizer.encode(CHECK_TEXT.read_text(encoding="utf-8"), add_bos=False)
    ids = [int(tokenizer.bos_token_id)] + [int(t) for t in text_ids[:ARGS.check_tokens - 1]]
    reference = "float32" if "float32" in models else "exact"
    worker = llama_cpp_peer.LlamaCppWorker(path, ARGS.threads, len(ids) + 8, env, logits_all=True)
    try:
        llama = worker.all_logits(ids)
    finally:
        worker.close()
    row = {"file": str(path), "against": f"kvlab {reference}",
           **logits_agreement(llama, models[reference].forward([ids]).logits[0])}
    if "q8" in models:  # the same rounding of activations as llama.cpp: how much closer
        row["q8"] = logits_agreement(llama, models["q8"].forward([ids]).logits[0])
    return {label: row}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / (max |want| + 1): the scale-aware logits error the issue's goals use."""
    return float(np.abs(got - want).max()) / (float(np.abs(want).max()) + 1.0)


def logits_agreement(llama: np.ndarray, kvlab_logits: np.ndarray) -> dict[str, float]:
    """How llama.cpp's logits [T, V] compare with kvlab's float32 logits of the same file."""
    diff = np.abs(llama - kvlab_logits)
    return {"max_abs": float(diff.max()), "relative": relative_error(llama, kvlab_logits),
            "mean_abs": float(diff.mean()), "max_logit": float(np.abs(kvlab_logits).max()),
            "top1": float((llama.argmax(-1) == kvlab_logits.argmax(-1)).mean())}


def kvlab_files(entries: list[str]) -> list[Path]:
    files = []
    for entry in entries:
        path = Path(entry)
        files += sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    return files


def main() -> None:
    from rich.console import Console

    import kvlab

    con = Console(stderr=True)
    out_dir = Path(ARGS.out)
    files, skipped = files_by_type(ARGS.file, ARGS.dir, ARGS.types)
    for line in skipped:
        con.print(f"[yellow]skipping {line}[/yellow]")
    if not files:
        raise SystemExit("no GGUF files to run: give --dir DIR or --file TYPE=PATH")

    bench_bin = None if ARGS.no_llama_cpp else llama_cpp_peer.find_llama_bench(ARGS.llama_bench)
    lib_dir = Path(ARGS.llama_cpp_lib) if ARGS.llama_cpp_lib else (
        bench_bin.parent if bench_bin is not None and (bench_bin.parent / "libllama.so").is_file() else None)
    env = peer_env(lib_dir)
    worker_ok = False
    if ARGS.no_llama_cpp:
        peer_note = worker_note = "skipped (--no-llama-cpp)"
    else:
        worker_note = llama_cpp_peer.worker_available(env)
        worker_ok = not worker_note
        worker_note = worker_note or f"llama-cpp-python with {lib_dir or 'its own libllama'}"
        peer_note = f"llama-bench {bench_bin}" if bench_bin else \
            f"no llama-bench (--llama-bench PATH or $LLAMA_BENCH); timed through {worker_note}" if worker_ok else \
            f"no llama-bench (--llama-bench PATH or $LLAMA_BENCH) and {worker_note}: llama.cpp columns skipped"
    con.print(f"llama.cpp timings: {peer_note}")
    con.print(f"llama.cpp logits: {worker_note}{'' if worker_ok else ': logits check skipped'}")

    rng = np.random.default_rng(0)
    best: dict[tuple[str, str, int], dict[str, float]] = {}  # (type, engine, context) -> decode/prefill s

    def note(key: tuple[str, str, int], decode: float | None = None, prefill: float | None = None) -> None:
        row = best.setdefault(key, {})
        for name, value in (("decode", decode), ("prefill", prefill)):
            if value is not None:
                row[name] = min(row.get(name, float("inf")), value)

    peer = None if ARGS.no_llama_cpp else LlamaBenchPeer(bench_bin, env) if bench_bin is not None else \
        WorkerPeer(files, env) if worker_ok else None
    bandwidths = [measure_bandwidth(3)]
    con.print(f"streaming read {bandwidths[-1] / 1e9:.1f} GB/s")
    # One file at a time (its engines' models loaded, run round after round, checked, then dropped), so a
    # 1B model, or a 3B one, fits: holding every type's models at once (and their float32 copies) took a
    # 1B bench past 24 GiB. The engines of one file still take turns, context by context, every round.
    configs, reads, stored_error, agreement, peak_rss = {}, {}, {}, {}, {}
    for kind, path in files.items():
        reset_peak_rss()
        models = {}
        models["exact"], tokenizer = kvlab.load(path, weights_dtype="stored", activations="float32")
        if models["exact"].quantized:  # llama.cpp's own arithmetic on such a file: activations rounded to int8
            models["q8"] = kvlab.load(path, weights_dtype="stored", activations="q8")[0]
        if not ARGS.no_float32:
            models["float32"] = kvlab.load(path, weights_dtype="float32")[0]
        con.print(f"loaded {kind}: {path} ({path.stat().st_size / 2**20:.1f} MiB), engines {', '.join(models)}")
        configs[kind] = config = models["exact"].config
        reads[kind] = {(engine, context): step_bytes(model, context) for engine, model in models.items()
                       for context in ARGS.contexts}
        check = rng.integers(300, config.vocab_size, size=(1, 16))
        got = models["exact"].forward(check).logits  # compiles each path once, and checks stored against float32
        if "float32" in models:
            stored_error[kind] = relative_error(got, models["float32"].forward(check).logits)
        for model in models.values():
            kvlab_run(model, check[:, :8], 2)
        prompts = {c: rng.integers(300, config.vocab_size, size=(1, c)) for c in ARGS.contexts}
        for round_number in range(ARGS.repeats):
            for context in ARGS.contexts:
                for engine, model in models.items():
                    prefill, decode = kvlab_run(model, prompts[context], ARGS.steps)
                    note((kind, f"kvlab {engine}", context), decode, prefill)
                if peer is not None:
                    decode, prefill = peer.decode(kind, path, context)
                    note((kind, "llama.cpp", context), decode, prefill if context in ARGS.prefill else None)
            if peer is not None:
                for tokens, seconds in peer.prefill(path).items():
                    note((kind, "llama.cpp", tokens), prefill=seconds)
            con.print(f"  {kind} round {round_number + 1}/{ARGS.repeats} done")
        if not ARGS.no_llama_cpp and worker_ok and tokenizer is not None:
            agreement.update(check_logits(f"{kind}: {path.name}", path, models, tokenizer, env))
        peak_rss[kind] = {"peak_rss_mib": peak_rss_bytes() / 2**20, "engines": list(models),
                          "file_mib": path.stat().st_size / 2**20}
        con.print(f"  {kind}: peak RSS {peak_rss[kind]['peak_rss_mib']:.0f} MiB with {', '.join(models)} loaded")
        del models, model
        release_free_memory()
    bandwidths.append(measure_bandwidth(3))
    bandwidth = max(bandwidths)
    if isinstance(peer, WorkerPeer):
        peer.close()
    if not ARGS.no_llama_cpp and not worker_ok:
        con.print(f"logits check skipped: {worker_note}")
    elif not ARGS.no_llama_cpp and tokenizer is not None:
        for path in kvlab_files(ARGS.kvlab_files):
            agreement.update(check_logits(f"kvlab quantize: {path.name}", path,
                                          {"float32": kvlab.load(path, weights_dtype="float32")[0]}, tokenizer, env))

    same_bytes = {}  # each kvlab file against the bench's file of the same type, tensor by tensor
    for path in kvlab_files(ARGS.kvlab_files):
        kind = next((k for k in files if path.name.lower().endswith(f"{k}.gguf".lower())), None)
        if kind is not None:
            same_bytes[path.name] = {"against": str(files[kind]), **{
                k: len(v) if k in ("identical", "differ") else v
                for k, v in llama_cpp_peer.compare_tensors(path, files[kind]).items()}}

    report = build_report(files, configs, reads, best, bandwidth, bandwidths, stored_error, agreement,
                          peer.cache_types if peer is not None else {}, peer_note, worker_note)
    report["kvlab_files_vs_peer_files"] = same_bytes
    report["peak_rss"] = peak_rss
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_gguf_peer.json").write_text(json.dumps(report, indent=2))
    markdown = render_markdown(report)
    (out_dir / "bench_gguf_peer.md").write_text(markdown)
    print(markdown)
    try:
        plot(report, out_dir / "bench_gguf_peer.png")
        con.print(f"plot: {out_dir / 'bench_gguf_peer.png'}")
    except ImportError:
        con.print("no plot: matplotlib is not installed")


def build_report(files, configs, reads, best, bandwidth, bandwidths, stored_error, agreement, cache_types,
                 peer_note, worker_note) -> dict:
    """Every measured number, with the bytes and rooflines behind each ratio."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    rows, prefill_rows = [], []
    for kind, path in files.items():
        c = configs[kind]
        peer_weights = llama_cpp_peer.decode_weight_bytes(llama_cpp_peer.gguf_tensors(path))
        type_k, type_v = cache_types.get(kind, ("f16", "f16"))
        for context in ARGS.contexts:
            row = {"type": kind, "file": str(path), "file_mib": path.stat().st_size / 2**20, "context": context}
            for engine in ENGINES:
                measured = best.get((kind, engine, context), {})
                if "decode" not in measured:
                    continue
                if engine == "llama.cpp":
                    read = peer_weights + llama_cpp_peer.kv_bytes(c.num_hidden_layers, c.num_key_value_heads,
                                                                  c.head_dim, context, type_k, type_v)
                else:
                    read = reads[kind][(engine.split()[1], context)]
                row[engine] = {"decode_s": measured["decode"], "tokens_per_s": 1.0 / measured["decode"],
                               "bytes_per_step": read, "roofline_s": read / bandwidth,
                               "x_roofline": measured["decode"] / (read / bandwidth)}
            rows.append(row)
        for tokens in ARGS.prefill:
            row = {"type": kind, "tokens": tokens}
            for engine in ENGINES:
                measured = best.get((kind, engine, tokens), {})
                if "prefill" in measured:
                    row[engine] = {"prefill_s": measured["prefill"], "tokens_per_s": tokens / measured["prefill"]}
            prefill_rows.append(row)
    return {"cpu": cpu, "threads": ARGS.threads, "load_average": os.getloadavg(), "steps": ARGS.steps,
            "repeats": ARGS.repeats, "bandwidth_bytes_per_s": bandwidth, "bandwidths": bandwidths,
            "llama_cpp": peer_note, "llama_cpp_logits": worker_note,
            "llama_cpp_cache_types": cache_types,
            "stored_vs_float32_relative_error": stored_error, "decode": rows, "prefill": prefill_rows,
            "logits_check": {"tolerance_relative": CHECK_RELATIVE, "tolerance_top1": CHECK_TOP1,
                             "tokens": ARGS.check_tokens, "text": str(CHECK_TEXT), "files": agreement}}


def _cell(row: dict, engine: str) -> str:
    r = row.get(engine)
    return f"{r['tokens_per_s']:.1f} ({r['x_roofline']:.2f}x)" if r else "-"


def _ratio(row: dict, a: str, b: str) -> str:
    return f"{row[a]['tokens_per_s'] / row[b]['tokens_per_s']:.2f}" if row.get(a) and row.get(b) else "-"


def render_markdown(report: dict) -> str:
    """The decode, prefill and logits tables as Markdown (README-ready), with the conditions they ran in."""
    load = report["load_average"][0]
    lines = [f"{report['cpu']}, {report['threads']} threads, streaming read {report['bandwidth_bytes_per_s'] / 1e9:.1f}"
             f" GB/s (best of {len(report['bandwidths'])} rounds: "
             + ", ".join(f"{b / 1e9:.1f}" for b in report["bandwidths"]) + f"), load average {load:.1f} at the end; "
             f"{report['llama_cpp']}.", "",
             "Decode tokens/s (x the roofline of the bytes that engine reads per step):", "",
             "| file | MiB | context | kvlab exact | kvlab q8 | kvlab float32 | llama.cpp | exact / llama.cpp "
             "| q8 / llama.cpp |", "|---|---|---|---|---|---|---|---|---|"]
    for row in report["decode"]:
        lines.append(f"| {row['type']} | {row['file_mib']:.0f} | {row['context']} | {_cell(row, 'kvlab exact')} | "
                     f"{_cell(row, 'kvlab q8')} | {_cell(row, 'kvlab float32')} | {_cell(row, 'llama.cpp')} | "
                     f"{_ratio(row, 'kvlab exact', 'llama.cpp')} | {_ratio(row, 'kvlab q8', 'llama.cpp')} |")
    lines += ["", "Prefill tokens/s (a prompt from an empty cache):", "",
              "| file | prompt | kvlab exact | kvlab q8 | kvlab float32 | llama.cpp | exact / llama.cpp "
              "| q8 / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for row in report["prefill"]:
        cells = [f"{row[e]['tokens_per_s']:.0f}" if row.get(e) else "-" for e in ENGINES]
        lines.append(f"| {row['type']} | {row['tokens']} | {' | '.join(cells)} | "
                     f"{_ratio(row, 'kvlab exact', 'llama.cpp')} | {_ratio(row, 'kvlab q8', 'llama.cpp')} |")
    lines += ["", "kvlab exact vs kvlab float32 on the same file, max |logit diff| / (max |logit| + 1), 16 tokens: "
              + ", ".join(f"{k} {v:.1e}" for k, v in report["stored_vs_float32_relative_error"].items())]
    check = report["logits_check"]
    if check["files"]:
        lines += ["", f"llama.cpp's logits vs kvlab float32 on the same file, every position of {check['tokens']} "
                  f"tokens of real text (pass: relative <= {check['tolerance_relative']}, top-1 >= "
                  f"{check['tolerance_top1']}):", "",
                  "| file | max abs diff | max abs logit | relative | top-1 agree | pass | vs kvlab q8: relative, "
                  "top-1 |", "|---|---|---|---|---|---|---|"]
        for label, r in check["files"].items():
            ok = r["relative"] <= check["tolerance_relative"] and r["top1"] >= check["tolerance_top1"]
            q8 = f"{r['q8']['relative']:.4f}, {100 * r['q8']['top1']:.1f}%" if "q8" in r else "-"
            lines.append(f"| {label} | {r['max_abs']:.3f} | {r['max_logit']:.1f} | {r['relative']:.4f} | "
                         f"{100 * r['top1']:.1f}% | {'yes' if ok else 'NO'} | {q8} |")
    else:
        lines += ["", f"llama.cpp logits check: {report['llama_cpp_logits']}"]
    if report.get("peak_rss"):
        lines += ["", "Peak RSS of this process per file (its engines' models loaded together, one file at a time):", "",
                  "| type | file MiB | engines loaded | peak RSS MiB |", "|---|---:|---|---:|"]
        for kind, r in report["peak_rss"].items():
            lines.append(f"| {kind} | {r['file_mib']:.0f} | {', '.join(r['engines'])} | {r['peak_rss_mib']:.0f} |")
    for name, r in report.get("kvlab_files_vs_peer_files", {}).items():
        lines.append(f"\n{name} vs {Path(r['against']).name}, tensor by tensor: {r['identical']} identical, "
                     f"{r['differ']} differ, stored in other types: {', '.join(r['other_type']) or 'none'}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Decode tokens/s per file, one panel per context, a bar per engine, its roofline as a tick above."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in report["decode"]})
    engines = ENGINES
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        rows = [r for r in report["decode"] if r["context"] == context]
        for i, (engine, color) in enumerate(zip(engines, ("tab:blue", "tab:purple", "tab:orange", "tab:green"))):
            xs = [j + (i - 1.5) * 0.2 for j, r in enumerate(rows) if r.get(engine)]
            if not xs:
                continue
            ax.bar(xs, [r[engine]["tokens_per_s"] for r in rows if r.get(engine)], 0.19, label=engine, color=color)
            ax.scatter(xs, [1 / r[engine]["roofline_s"] for r in rows if r.get(engine)], marker="_", s=200,
                       color="black", label="roofline (its bytes)" if i == 0 else None)
        ax.set_xticks(range(len(rows)), [r["type"] for r in rows])
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_title(f"decode at context {context}")
        ax.set_ylabel("tokens/s (higher is better)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{report['cpu']}, {report['threads']} threads, streaming read "
                 f"{report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (same run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
