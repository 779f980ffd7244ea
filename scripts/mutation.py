"""Mutation testing of the core, and branch coverage of all of kvlab: one command, one report.

    python scripts/mutation.py                      # mutmut (1 worker), then the kill rate, then coverage
    python scripts/mutation.py --jobs 4             # more mutmut workers on a machine you have to yourself
    python scripts/mutation.py --report-only        # kill rate from the last run's results (mutants/)
    python scripts/mutation.py --no-coverage        # skip the coverage run
    python scripts/mutation.py 'kvlab.sampling.sampler*'   # (re)run only mutants matching these names

mutmut's settings (which modules it mutates, which tests it runs) are in pyproject.toml, [tool.mutmut].
Hypothesis runs with the `mutation` profile (tests/conftest.py): derandomized, no shrinking. Mutants listed
in scripts/equivalent_mutants.txt (each with the reason it cannot be killed) are left out of the
denominator of the kill rate and printed separately. Not part of CI: a full run takes one to two hours on
one core. Coverage runs the whole suite once with `--cov=kvlab --cov-branch` and prints a per-module table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "scripts" / "equivalent_mutants.txt"
KILLED = {1: "killed", 3: "killed", 36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout",
          255: "timeout", -11: "segfault", -9: "segfault"}  # all count as detected
NAMES = {0: "survived", 33: "no tests", 5: "no tests", 34: "skipped", None: "not checked"}


def equivalent_mutants() -> dict[str, str]:
    """name -> reason, from lines `mutant_name  # reason` (blank lines and # comments ignored)."""
    found = {}
    if EQUIVALENTS.is_file():
        for line in EQUIVALENTS.read_text().splitlines():
            name, _, reason = line.partition("#")
            if name.strip():
                found[name.strip()] = reason.strip()
    return found


def results() -> dict[str, dict[str, int | None]]:
    """module path -> {mutant name: exit code}, from mutmut's per-file .meta records."""
    out = {}
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        if codes:
            out[str(meta.relative_to(ROOT / "mutants"))[: -len(".meta")]] = codes
    return out


def status(code: int | None) -> str:
    return KILLED.get(code) or NAMES.get(code, "suspicious")


def report() -> float:
    """Print the per-module table and the survivors; return the overall kill rate (0..1)."""
    equivalent = equivalent_mutants()
    by_module = results()
    if not by_module:
        sys.exit("no mutmut results under mutants/: run without --report-only first")
    total = Counter()
    rows, survivors = [], defaultdict(list)
    for module, codes in by_module.items():
        counts = Counter()
        for name, code in codes.items():
            kind = status(code)
            if kind in ("killed", "timeout", "segfault"):
                counts["killed"] += 1
            elif name in equivalent:
                counts["equivalent"] += 1
            else:
                counts[kind] += 1
                if kind != "not checked":
                    survivors[module].append(f"{name} ({kind})")
        counts["total"] = len(codes)
        total.update(counts)
        rows.append((module, counts))
    print(f"\n{'module':34} {'mutants':>8} {'killed':>7} {'equiv.':>7} {'survived':>9} {'no tests':>9} "
          f"{'pending':>8} {'kill rate':>10}")
    for module, c in rows + [("all", total)]:
        scored = c["total"] - c["equivalent"] - c["not checked"]
        rate = c["killed"] / scored if scored else 0.0
        print(f"{module:34} {c['total']:8} {c['killed']:7} {c['equivalent']:7} {c['survived']:9} "
              f"{c['no tests']:9} {c['not checked']:8} {rate:10.1%}")
    scored = total["total"] - total["equivalent"] - total["not checked"]
    rate = total["killed"] / scored if scored else 0.0
    print(f"\nkill rate: {total['killed']} killed of {scored} non-equivalent checked mutants = {rate:.1%} "
          f"({total['equivalent']} equivalent, listed in {EQUIVALENTS.relative_to(ROOT)})")
    checked = total["total"] - total["not checked"]
    print(f"counting the equivalent ones as survivors: {total['killed']} of {checked} = "
          f"{total['killed'] / checked if checked else 0.0:.1%}; not run yet: {total['not checked']}")
    for module, names in survivors.items():
        print(f"\nsurvivors in {module} (`mutmut show NAME` prints the diff):")
        for name in names:
            print(f"  {name}")
    stale = sorted(set(equivalent) - {n for codes in by_module.values() for n in codes})
    if stale:
        print(f"\nequivalent_mutants.txt names {len(stale)} mutants that no longer exist: {stale}")
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*", help="only (re)run mutants matching these names/globs")
    parser.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1: a shared machine)")
    parser.add_argument("--report-only", action="store_true", help="report the last run's results")
    parser.add_argument("--no-coverage", action="store_true", help="skip the branch-coverage run")
    args = parser.parse_args()
    env = {**os.environ, "HYPOTHESIS_PROFILE": "mutation"}
    if not args.report_only:
        mutmut = Path(sys.executable).with_name("mutmut")
        command = [str(mutmut) if mutmut.exists() else "mutmut", "run", "--max-children", str(args.jobs),
                   *args.mutants]
        subprocess.run(command, cwd=ROOT, env=env, check=False)
    rate = report()
    if not args.no_coverage:
        print("\nbranch coverage of kvlab (whole test suite):", flush=True)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cov=kvlab",
                        "--cov-branch", "--cov-report=term", "tests"], cwd=ROOT, check=False)
    return 0 if rate >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
