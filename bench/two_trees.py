"""Two kvlab trees measured side by side in one run (`--old TREE` of the kernel benches): each round runs a
worker script in a fresh process per tree (its own imports, numba cache and threads), alternating who goes
first, so a shared machine's drift hits both alike; the figure to quote per cell is the median of the
per-round ratios new/old (one noisy round cannot move it much)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

Cells = dict[str, float]


def run_worker(worker: str, tree: Path, *argv: str) -> Cells:
    """The JSON object the worker prints last, run with `tree` first on the import path and as its cwd."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", worker, *argv], env=env, check=True, cwd=tree,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternate(trees: dict[str, Path], rounds: int, measure: Callable[[Path], Cells]) -> dict[str, list[Cells]]:
    """Every tree's cells per round, the order of the trees reversed every other round."""
    runs: dict[str, list[Cells]] = {name: [] for name in trees}
    for r in range(rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            runs[name].append(measure(trees[name]))
    return runs


def print_cells(runs: dict[str, list[Cells]], width: int) -> None:
    """One line per cell: each tree's best over the rounds (higher is faster), and with an old tree the
    median of the per-round speed ratios new/old."""
    for cell in runs["new"][0]:
        line = f"{cell:{width}s}" + "".join(f"  {name} {max(r[cell] for r in runs[name]):7.1f}" for name in runs)
        if "old" in runs:
            ratios = [new[cell] / old[cell] for new, old in zip(runs["new"], runs["old"])]
            line += f"  new/old speed (median of rounds) {statistics.median(ratios):.3f}"
        print(line)


def add_arguments(parser: argparse.ArgumentParser, rows: list[int]) -> None:
    """The options every row-count kernel bench shares: W's shape, rows of x, repeats, rounds, --old."""
    parser.add_argument("--shape", nargs=2, type=int, default=[1536, 512], metavar=("N", "K"))
    parser.add_argument("--rows", nargs="+", type=int, default=rows)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--old", type=Path, help="a second kvlab tree to run side by side (new = this checkout)")


def compare(args: argparse.Namespace, here: Path, measure: Callable[[Path], Cells], unit: str, width: int) -> None:
    """Measure this checkout (and `args.old`), alternating, and print the cells."""
    trees = {"new": here} if args.old is None else {"old": args.old.resolve(), "new": here}
    runs = alternate(trees, args.rounds, measure)
    threads = getattr(args, "threads", 1)
    print(f"{unit}, {'one thread' if threads == 1 else f'{threads} threads (wall time)'}, W {args.shape[0]}x"
          f"{args.shape[1]}, best of {args.repeats} x {args.rounds} round(s)")
    print_cells(runs, width)
