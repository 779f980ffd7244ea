"""`kvlab verify` runs speculative schedules: the engine with prompt lookup (and with a draft whose last guess
is always wrong) in a tight pool gives, for every emitted token, the logprob a full recompute gives, within
the verifier's tolerance; a speculation that kept a wrong guess is caught."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvlab
from kvlab import TinyLlama
from kvlab.engine import speculative
from kvlab.engine.draft import DraftProposer
from kvlab.engine.request import Request
from kvlab.sampling.sampler import SamplingParams
from kvlab.verify import verify_model

SPECULATIVE = {"speculative", "speculative-draft"}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_schedules_equal_a_full_recompute(dtype, seed):
    model = TinyLlama(seed=7, dtype=dtype)
    results = {r.name: r for r in verify_model(model, seed=seed)}
    assert SPECULATIVE <= set(results)
    for name in SPECULATIVE:
        assert results[name].passed, results[name]
        assert np.isfinite(results[name].max_abs_error)


def test_the_shipped_model_passes_in_float64():
    model, _ = kvlab.load(dtype="float64")
    results = {r.name: r for r in verify_model(model)}
    assert all(results[name].passed for name in SPECULATIVE), [results[n] for n in SPECULATIVE]


def test_a_speculation_that_keeps_a_wrong_guess_fails_the_schedule(monkeypatch):
    """The check can fail: an acceptance rule that keeps every guess emits tokens plain decoding would not."""
    def keep_everything(draft, rows, draw):
        for i in range(len(draft) + 1):
            draw(rows[i:i + 1])
        bonus = int(np.argmax(rows[len(draft)]))
        return speculative.Acceptance(list(draft) + [bonus], len(draft))

    monkeypatch.setattr(speculative, "accept", keep_everything)
    results = {r.name: r for r in verify_model(TinyLlama(seed=7))}
    assert not results["speculative-draft"].passed


def test_a_draft_asked_twice_without_a_verification_guesses_the_same():
    """A step that does not verify (the sequence not scheduled, its guesses trimmed by the token budget)
    leaves the draft's cache holding every token: the next proposal feeds the last one again."""
    model = TinyLlama(seed=3)
    request = Request("r", [5, 6, 7, 8], SamplingParams(), b"root", 10, frozenset())
    seq = request.seqs[0]
    draft = DraftProposer(model)
    first = draft.propose(seq, 3)
    assert draft.propose(seq, 3) == first
    draft.rollback(seq)
    assert draft.propose(seq, 3) == first


def test_kvlab_verify_lists_the_speculative_schedules():
    proc = subprocess.run([sys.executable, "-m", "kvlab", "verify", "--dtype", "float64"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "speculative" in proc.stdout and "speculative-draft" in proc.stdout and "PASS" in proc.stdout
