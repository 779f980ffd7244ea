"""Shared test settings: hypothesis runs derandomized in CI so a red build reproduces locally.

HYPOTHESIS_PROFILE=mutation (set by scripts/mutation.py) is derandomized and skips shrinking: a mutant only
needs one failing example, and shrinking it would cost minutes per mutant.
"""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow])
# `pytest --hypothesis-profile=explore tests/test_engine_liveness.py ...`: many new random examples, as a
# developer's run before a stop (CONTRIBUTING.md); keep what it finds as an @example so CI replays it
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("mutation", derandomize=True, deadline=None, max_examples=10, database=None,
                          phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


MAX_AUTO_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command) runs a worker per core, at most MAX_AUTO_WORKERS: a cold run is
    mostly numba compiling, and each worker compiles every kernel its files meet that no other worker has
    cached yet (~1-2 GiB of LLVM each at its peak), so past a few workers more cores buy little and cost
    memory. Two cores (CI) give two workers: a cold run took 12m39s there against 22m46s in one process."""
    return max(1, min(os.cpu_count() or 1, MAX_AUTO_WORKERS))


def pytest_terminal_summary(terminalreporter):
    """The adversarial suites' tally: bad inputs tried and handled cleanly (tests/adversarial.py)."""
    import sys

    tally = getattr(sys.modules.get("adversarial"), "TALLY", None)
    if tally and tally["tried"]:
        terminalreporter.write_line(f"adversarial inputs: {tally['tried']} tried, {tally['clean']} handled "
                                    "cleanly (one KVLabError / one stderr line, state unchanged)")
    server = getattr(sys.modules.get("adversarial"), "SERVER_TALLY", None)
    if server and server["tried"]:
        terminalreporter.write_line(f"adversarial server requests: {server['tried']} tried, {server['clean']} "
                                    "answered cleanly (OpenAI error shape, the right 4xx, pool balanced)")


@pytest.fixture(autouse=True)
def _grammar_compiler_after_fork():
    """A process forked after kvlab started its grammar-building thread (kvlab/sampling/grammar.py) inherits
    the executor but not the thread, so its first uncached compile waits forever: mutmut forks each mutant's
    test run so, and such a hang read as a killed mutant (a timeout). Start a new compiler thread there."""
    import sys
    import threading

    grammar = sys.modules.get("kvlab.sampling.grammar")
    compiler = getattr(grammar, "_COMPILER", None)
    if compiler is not None and not any(thread.is_alive() for thread in compiler._threads):
        grammar._COMPILER, grammar._COMPILER_LOCK = None, threading.Lock()
    yield
