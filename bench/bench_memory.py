"""Where a GGUF model's memory goes: peak RSS of `kvlab generate`, and the bytes stage by stage.

One model at a time, each measurement in its own process (so a 1B model, or a 3B one, fits beside
nothing else), for every file and activations mode:

  * `peak`: the peak RSS (the kernel's ru_maxrss of the child) of
    `kvlab generate -m FILE -n 16 --activations MODE --temp 0 "hello"`, next to the file's size and to
    what `kvlab memory --model FILE` predicts for the same run;
  * `stages` (the same process layout, in-process): the peak and the resident bytes after each stage
    (imports, tokenizer and weights read, model built, q8 layout, kernels warmed up, cache, prefill and
    16 decode steps), each stage's peak measured alone (Linux's clear_refs resets the high-water mark),
    and the model's resident weight bytes by kind: codes, scales/offsets, the integer kernels' layout,
    float arrays.

    python bench/bench_memory.py FILE.gguf [FILE.gguf ...] [--modes float32 q8] [--no-stages]

Writes bench/out/bench_memory.json and .md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
MIB = 1 << 20
PROMPT = "hello"
NEW_TOKENS = 16


def status_kib(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Reset this process's high-water mark of resident memory to its current RSS (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child_peak(command: list[str]) -> tuple[int, float, str]:
    """(peak RSS in bytes, seconds, stderr's last line) of a command run to completion."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{err}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start, err.strip().splitlines()[-1] if err.strip() else ""


def weight_bytes(model) -> dict[str, int]:
    """The model's resident weight bytes by kind (each array counted once)."""
    import numpy as np

    from kvlab.model.quantized import QuantizedMatrix, RowStack

    seen: set[int] = set()
    out = {"codes": 0, "scales+offsets": 0, "float matrices": 0, "float vectors": 0}

    def add(kind: str, array) -> None:
        if array is None or not isinstance(array, np.ndarray) or id(array) in seen:
            return
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        if id(base) in seen:
            return
        seen.add(id(base))
        out[kind] += base.nbytes

    def matrix(w) -> None:
        if isinstance(w, RowStack):
            for p in w.parts:
                matrix(p)
        elif isinstance(w, QuantizedMatrix):
            tiles = w._tiles  # the resident layout, read without converting
            for part in (tiles, w.tail):
                if part is not None:
                    add("codes", part.codes)
                    add("scales+offsets", part.scales)
                    add("scales+offsets", part.offsets)
            if w._dot is not None:
                add("codes", w._dot[0])
                for array in (*w._dot[1:3], *w._dot[4:]):
                    add("scales+offsets", array)
        elif isinstance(w, np.ndarray):
            add("float matrices" if w.ndim == 2 else "float vectors", w)

    matrix(model.embed)
    matrix(model.lm_head)
    add("float vectors", model.norm)
    for layer in model.layers:
        for value in vars(layer).values():
            matrix(value)
    return out


def stages(path: str, activations: str, prompt_text: str = PROMPT) -> dict:
    """Peak and resident MiB after each stage of a `kvlab generate`-like run, in this process."""
    rows: list[dict] = []

    def mark(stage: str) -> None:
        rows.append({"stage": stage, "peak_mib": status_kib("VmHWM") / 1024, "rss_mib": status_kib("VmRSS") / 1024})
        reset_peak()

    reset_peak()

    import kvlab  # noqa: F401
    from kvlab.kernels import qgemv  # noqa: F401  (numba and the kernels' modules)
    mark("imports (kvlab, numpy, numba)")
    from kvlab.loader import load
    model, tokenizer = load(path, activations=activations)
    mark(f"weights read, model built (activations={activations})")
    model.warm_up()
    mark("kernels warmed up (numba cache)")
    prompt = tokenizer.encode(prompt_text)
    cache = model.new_cache(1, capacity=len(prompt) + NEW_TOKENS)
    mark(f"cache for {len(prompt) + NEW_TOKENS} positions")
    from kvlab.generation.generate import stream_generate

    for _ in stream_generate(model, [prompt], NEW_TOKENS, cache=cache, temperature=0.0):
        pass
    mark(f"prefill + {NEW_TOKENS} tokens")
    weights = {k: v / MIB for k, v in weight_bytes(model).items()}
    kv = sum(a.nbytes for a in getattr(getattr(cache, "store", None), "_keys", []) + getattr(getattr(cache, "store", None), "_values", [])) / MIB
    return {"stages": rows, "weights_mib": weights, "kv_mib": kv, "file_mib": os.path.getsize(path) / MIB}


def predicted(path: str, activations: str, tokens: int) -> dict:
    """`kvlab memory --model FILE --tokens N --activations MODE --json`'s predicted peak (bytes by part)."""
    out = subprocess.run([sys.executable, "-m", "kvlab", "memory", "--model", path, "--tokens", str(tokens),
                          "--activations", activations, "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["predicted_peak"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*")
    p.add_argument("--modes", nargs="+", default=["float32", "q8"])
    p.add_argument("--no-stages", action="store_true", help="only the peak of `kvlab generate`")
    p.add_argument("--prompt", default=PROMPT, help=f"the prompt (default {PROMPT!r}; a long one shows prefill)")
    p.add_argument("--stages-of", nargs=3, metavar=("FILE", "MODE", "PROMPT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stages_of:  # the child: one model, one mode
        print(json.dumps(stages(*args.stages_of)))
        return 0
    kvlab = [sys.executable, "-m", "kvlab"]
    results = []
    for path in args.files:
        for mode in args.modes:
            peak, seconds, line = child_peak(kvlab + ["generate", "-m", path, "-n", str(NEW_TOKENS), "--temp", "0",
                                                      "--activations", mode, args.prompt])
            row = {"file": path, "file_mib": os.path.getsize(path) / MIB, "activations": mode,
                   "generate_peak_mib": peak / MIB, "seconds": seconds, "stats": line}
            try:
                prompt = int(line.split("prompt ")[1].split(" tokens")[0]) if "prompt " in line else 1
                row["predicted"] = predicted(path, mode, prompt + NEW_TOKENS)
            except (subprocess.CalledProcessError, KeyError, ValueError, IndexError):
                pass  # a checkout whose `kvlab memory` predicts no peak
            if not args.no_stages:
                out = subprocess.run([sys.executable, __file__, "--stages-of", path, mode, args.prompt], check=True,
                                     capture_output=True, text=True).stdout
                row.update(json.loads(out))
            results.append(row)
            print(json.dumps(row, indent=1), flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_memory.json").write_text(json.dumps(results, indent=1))
    lines = ["| file | MiB | activations | `kvlab generate` peak MiB | peak / file | predicted MiB |",
             "|---|---:|---|---:|---:|---:|"]
    for r in results:
        pred = r.get("predicted", {}).get("peak")
        lines.append(f"| {Path(r['file']).name} | {r['file_mib']:.0f} | {r['activations']} | "
                     f"{r['generate_peak_mib']:.0f} | {r['generate_peak_mib'] / r['file_mib']:.2f} | "
                     f"{'' if pred is None else f'{pred / MIB:.0f}'} |")
    (OUT / "bench_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
