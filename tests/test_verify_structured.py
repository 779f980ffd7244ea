"""`kvlab verify` with a grammar on (kvlab/verify/structured.py): constrained greedy tokens and masked logits
are the same in every schedule (one cache, chunks, a batch whose masks are filled together, the paged
forward, the engine with preemption and a warm prefix cache, speculation) as in a plain full recompute; a
mask that depends on its company, or an allowed set that differs, fails; the CLI flags and their errors."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvlab.sampling.sampler as sampler_module
from kvlab.model.llama import TinyLlama
from kvlab.sampling.grammar import GrammarSpec, compile_grammar, grammar_vocab, mask_logits
from kvlab.tokenizer import ByteTokenizer
from kvlab.verify import verify_model
from kvlab.verify.structured import Answer, compare, reference_answer

MODEL = TinyLlama(seed=7)  # the seeds' model, float64
TOKENIZER = ByteTokenizer()
SCHEMAS = {
    "enum+range": {"type": "object", "additionalProperties": False, "required": ["mood", "n"],
                   "properties": {"mood": {"enum": ["merry", "sad"]},
                                  "n": {"type": "integer", "minimum": 0, "maximum": 99}}},
    "array": {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 1, "maxItems": 3},
    "anyof": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9},
                        {"type": "object", "additionalProperties": False, "required": ["w"],
                         "properties": {"w": {"type": "string", "maxLength": 4}}}]},
}
SCHEMA_CHECKS = ["schema decode", "schema chunks", "schema batch", "schema paged", "schema engine",
                 "schema speculative"]


def grammar(schema):
    vocab = grammar_vocab(TOKENIZER, MODEL.config.vocab_size, TOKENIZER.eos_token_ids)
    return compile_grammar(GrammarSpec.json_schema(schema), vocab)


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(sorted(SCHEMAS)), seed=st.integers(0, 2**16), length=st.integers(4, 28))
def test_every_schedule_gives_the_reference_tokens_and_masked_logits(name, seed, length):
    results = verify_model(MODEL, seed=seed, length=length, grammar=grammar(SCHEMAS[name]), tokenizer=TOKENIZER)
    assert [r.name for r in results][-len(SCHEMA_CHECKS):] == SCHEMA_CHECKS
    failed = [(r.name, r.max_abs_error, r.tolerance) for r in results if not r.passed]
    assert not failed
    assert all(r.max_abs_logit > 0 for r in results)  # each check compared something


def test_the_reference_answer_is_constrained_and_ends_valid():
    prompt = np.random.default_rng(1).integers(0, MODEL.config.vocab_size, 10).tolist()
    answer = reference_answer(MODEL, grammar(SCHEMAS["enum+range"]), prompt, 40)
    assert answer.tokens[-1] == TOKENIZER.eos_token_id
    jsonschema.validate(json.loads(bytes(answer.tokens[:-1]).decode()), SCHEMAS["enum+range"])
    for masked, token in zip(answer.masked, answer.tokens):
        assert np.isfinite(masked[token]) and not np.isfinite(masked).all()


def test_a_mask_that_depends_on_its_company_fails_the_batched_schedules(monkeypatch):
    """Negative control: a sampler that masks only the first row of a batch. Alone nothing changes; batched,
    the other rows draw tokens the grammar forbids, and the verifier says so."""
    def first_row_only(logits, matchers):
        return mask_logits(logits, [matchers[0], *[None] * (len(matchers) - 1)])

    monkeypatch.setattr(sampler_module, "mask_logits", first_row_only)
    results = {r.name: r for r in verify_model(MODEL, seed=3, length=12, grammar=grammar(SCHEMAS["array"]),
                                               tokenizer=TOKENIZER)}
    assert results["schema decode"].passed and results["schema chunks"].passed
    assert not results["schema batch"].passed and results["schema batch"].max_abs_error == float("inf")


def test_compare_fails_on_a_different_token_or_allowed_set():
    row = np.array([0.5, -np.inf, 2.0, -np.inf])
    want = Answer()
    want.add(2, np.array([0.5, 1.0, 2.0, 3.0]), row)
    same = Answer()
    same.add(2, np.array([0.5, 1.0, 2.0, 3.0]), row + 1e-15)
    assert compare(same, want)[0] <= 1e-15
    wider = Answer()
    wider.add(2, np.array([0.5, 1.0, 2.0, 3.0]), np.array([0.5, 1.0, 2.0, -np.inf]))
    assert compare(wider, want)[0] == float("inf")
    other = Answer()
    other.add(0, np.array([0.5, 1.0, 2.0, 3.0]), row)
    assert compare(other, want)[0] == float("inf")


def kvlab_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab", "verify", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_verify_with_a_json_schema_runs_the_schema_schedules():
    done = kvlab_cli("--json", "--length", "12", "--json-schema", json.dumps(SCHEMAS["enum+range"]))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] and "JSON schema on" in report["model"]
    assert [c["name"] for c in report["checks"]][-len(SCHEMA_CHECKS):] == SCHEMA_CHECKS


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "{bad"], "--json-schema: the JSON schema is not valid JSON"),
    (["--json-schema", '{"type": "object", "minProperties": "x"}'], "--json-schema: invalid JSON schema"),
    (["--grammar", "root ::= ("], "--grammar: invalid grammar"),
    (["--json-schema", "{}", "--grammar", 'root ::= "a"'], "give one of"),
    (["--json-schema-file", "/nonexistent/schema.json"], "--json-schema-file /nonexistent/schema.json: cannot read"),
])
def test_cli_verify_refuses_a_bad_grammar_in_one_line(args, message):
    done = kvlab_cli("--model", "/nonexistent/model.gguf", *args)  # refused before the model is looked for
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
