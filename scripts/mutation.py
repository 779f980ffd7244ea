"""Mutation testing of the core, and branch coverage of all of kvlab: one command, one report.

    python scripts/mutation.py                      # mutmut (1 worker), then the kill rate, then coverage
    python scripts/mutation.py --jobs 4             # more mutmut workers on a machine you have to yourself
    python scripts/mutation.py --report-only        # kill rate from the last run's results (mutants/)
    python scripts/mutation.py --no-coverage        # skip the coverage run
    python scripts/mutation.py 'kvlab.sampling.sampler*'   # (re)run only mutants matching these names
    python scripts/mutation.py --focus forward-engine  # a few modules against a few test files (below)

A focus ([tool.kvlab-mutation.focus.NAME] in pyproject.toml: `mutants`, name patterns, and `tests`, test
files) runs mutmut in .mutation/NAME/ (git-ignored; kvlab/ and tests/ are links to the worktree's) with
the test selection cut to those files. Why: mutmut runs, for each mutant, every selected test that calls
the mutated function, and the layer loop's Ops and Attention are called by nearly every test; a surviving
mutant of ops.py would cost the whole in-process suite. The focus's tests are the ones written against
those modules (exact against a recompute), so a mutant they miss is a missing test there.

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
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT  # where mutmut runs and keeps mutants/: ROOT, or .mutation/NAME for a focus
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
    for meta in sorted((WORK / "mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        if codes:
            out[str(meta.relative_to(WORK / "mutants"))[: -len(".meta")]] = codes
    return out


def focus_root(name: str) -> tuple[Path, list[str]]:
    """Set up .mutation/NAME for the focus NAME of pyproject.toml; return it and the focus's mutant patterns.

    The folder holds links to the worktree's kvlab/ and tests/ (new tests join at once) and a pyproject.toml
    whose [tool.mutmut] is the worktree's with the test selection (and `only_mutate`, if the focus gives
    one) replaced by the focus's.
    """
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    focus = project["tool"].get("kvlab-mutation", {}).get("focus", {})
    if name not in focus:
        sys.exit(f"no focus {name!r} in pyproject.toml [tool.kvlab-mutation.focus]; known: {sorted(focus)}")
    work = ROOT / ".mutation" / name
    work.mkdir(parents=True, exist_ok=True)
    for folder in ("kvlab", "tests"):
        link = work / folder
        if not link.is_symlink():
            link.symlink_to(Path("..", "..", folder))
    settings = {**project["tool"]["mutmut"], "pytest_add_cli_args_test_selection": focus[name]["tests"]}
    if "only_mutate" in focus[name]:  # fewer mutated files: fewer trampolines slowing every test down
        settings["only_mutate"] = focus[name]["only_mutate"]
    lines = ["# written by scripts/mutation.py --focus from ../../pyproject.toml: do not edit",
             "[tool.pytest.ini_options]", 'testpaths = ["tests"]', "", "[tool.mutmut]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]  # JSON lists are TOML lists
    text = "\n".join(lines) + "\n"
    if not (work / "pyproject.toml").is_file() or (work / "pyproject.toml").read_text() != text:
        (work / "pyproject.toml").write_text(text)
    return work, list(focus[name]["mutants"])


def status(code: int | None) -> str:
    return KILLED.get(code) or NAMES.get(code, "suspicious")


def report(patterns: list[str] | None = None) -> float:
    """Print the per-module table and the survivors (of the mutants matching `patterns`, if given); return
    the overall kill rate (0..1)."""
    equivalent = equivalent_mutants()
    by_module = results()
    if patterns:
        by_module = {module: kept for module, codes in by_module.items()
                     if (kept := {n: c for n, c in codes.items() if any(fnmatch(n, p) for p in patterns)})}
    if not by_module:
        sys.exit(f"no mutmut results under {WORK / 'mutants'}: run without --report-only first")
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
        rate = f"{c['killed'] / scored:10.1%}" if scored else f"{'-':>10}"  # none checked yet: no rate
        print(f"{module:34} {c['total']:8} {c['killed']:7} {c['equivalent']:7} {c['survived']:9} "
              f"{c['no tests']:9} {c['not checked']:8} {rate}")
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
    if stale and not patterns:  # (a focus sees only its own modules' mutants)
        print(f"\nequivalent_mutants.txt names {len(stale)} mutants that no longer exist: {stale}")
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*", help="only (re)run mutants matching these names/globs")
    parser.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1: a shared machine)")
    parser.add_argument("--report-only", action="store_true", help="report the last run's results")
    parser.add_argument("--no-coverage", action="store_true", help="skip the branch-coverage run")
    parser.add_argument("--focus", metavar="NAME", help="a focus of pyproject.toml [tool.kvlab-mutation.focus]")
    args = parser.parse_args()
    global WORK
    mutants = patterns = args.mutants
    if args.focus:  # mutmut mutates only the focus's files; names given rerun those mutants
        WORK, patterns = focus_root(args.focus)
    # mutmut forks each mutant's run from a process whose tests already ran numba's parallel kernels; GNU
    # OpenMP (numba's default layer here) kills a forked child that launches one (SIGTERM, "fork() called
    # from a process already using GNU OpenMP"): every such mutant read as "suspicious". workqueue forks.
    env = {**os.environ, "HYPOTHESIS_PROFILE": "mutation", "NUMBA_THREADING_LAYER": "workqueue"}
    if not args.report_only:
        mutmut = Path(sys.executable).with_name("mutmut")
        command = [str(mutmut) if mutmut.exists() else "mutmut", "run", "--max-children", str(args.jobs),
                   *mutants]
        subprocess.run(command, cwd=WORK, env=env, check=False)
    rate = report(patterns if args.focus else None)
    if not args.no_coverage:
        print("\nbranch coverage of kvlab (whole test suite):", flush=True)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cov=kvlab",
                        "--cov-branch", "--cov-report=term", "tests"], cwd=ROOT, check=False)
    return 0 if rate >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
