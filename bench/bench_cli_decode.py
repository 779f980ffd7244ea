"""`kvlab generate` of two kvlab trees side by side: decode ms/token and prefill (TTFT) as the user sees them.

Each round runs the command once per tree, in a fresh process (its own imports and numba disk cache), on
the same model, prompt and flags (greedy, --ignore-eos, so both decode exactly `-n` tokens); the trees
take turns and swap who goes first each round, so drift on a shared machine hits both alike. The figures
come from each run's stats line (`prefill X ms`, `decode N tokens, Y ms/token`), which leaves kernel
compiles and process start out. Prints the best of the rounds per tree and the median of the per-round
ratios new/old (the figure to quote).

    git worktree add /tmp/kvlab-old <commit>
    python bench/bench_cli_decode.py --old /tmp/kvlab-old --new . [--model PATH.gguf] [-n 128] [--rounds 6]

Compare like with like: since abb984b a block-quantized GGUF file computes with int8 activations by default
("q8"), where older trees default to exact float32 products; `--activations float32` (or q8, where both trees
have it) passes the same products to both trees (every tree since --activations exists accepts both names).
On a shared machine quote the median of the per-round ratios with their spread (min..max), never the best
of one tree against the best of the other.

Why a separate bench from bench_ab_decode.py: that one times the model's decode step in both trees; this
one times the whole command, so it sees what changed around the step (e.g. the command moving from the
contiguous cache to the engine: scheduler, block tables, detokenizing).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"prefill ([\d.]+) ms .*decode (\d+) tokens, [\d.]+ ms/token \(([\d.]+) tok/s\)")
PROMPT = ("The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly; "
          "pack my box with five dozen liquor jugs. ")


def run(tree: str, args: argparse.Namespace, prompt: str) -> tuple[float, float]:
    """(prefill ms, decode ms/token) of one `kvlab generate` in `tree`."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    command = [sys.executable, "-m", "kvlab.cli", "generate", "-n", str(args.n), "--temperature", "0",
               "--ignore-eos", "--no-display-prompt", prompt]
    if args.model:  # absolute: each tree runs in its own folder
        command[4:4] = ["--model", os.path.abspath(args.model)]
    if args.kv_dtype:
        command[4:4] = ["--kv-cache-dtype", args.kv_dtype]
    if args.activations:  # e.g. q8 in both trees, where one tree's default is not
        command[4:4] = ["--activations", args.activations]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
    found = LINE.search(done.stderr)
    if done.returncode != 0 or found is None or int(found[2]) != args.n:
        raise SystemExit(f"{tree}: kvlab generate failed or stopped early:\n{done.stderr[-2000:]}")
    return float(found[1]), 1e3 / float(found[3])  # from tok/s: the line's ms/token has one decimal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the baseline tree (a checkout or worktree)")
    parser.add_argument("--new", default=".", help="the tree under test (default .)")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    parser.add_argument("-n", type=int, default=128, help="new tokens per run (default 128)")
    parser.add_argument("--repeat", type=int, default=1, help="the prompt text repeated this many times")
    parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--activations", default=None, help="--activations for both trees (default: each tree's own)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    prompt = PROMPT * args.repeat
    trees = {"old": args.old, "new": args.new}
    for tree in trees.values():  # warm numba's disk caches (a first run compiles)
        run(tree, args, prompt)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            figures[name].append(run(trees[name], args, prompt))
        print(f"round {r + 1}: " + "  ".join(f"{n} prefill {figures[n][-1][0]:.1f} ms decode "
                                            f"{figures[n][-1][1]:.2f} ms/token" for n in trees), flush=True)
    decode = [new[1] / old[1] for old, new in zip(figures["old"], figures["new"])]
    prefill = [new[0] / old[0] for old, new in zip(figures["old"], figures["new"])]
    for name in trees:
        print(f"{name}: best prefill {min(f[0] for f in figures[name]):.1f} ms, best decode "
              f"{min(f[1] for f in figures[name]):.2f} ms/token")
    for label, ratios in (("decode ms/token", decode), ("prefill ms (TTFT)", prefill)):
        print(f"new/old {label}: median of rounds {statistics.median(ratios):.3f}, spread "
              f"{min(ratios):.3f}..{max(ratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
