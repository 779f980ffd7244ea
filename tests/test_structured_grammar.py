"""Structured output in-process: grammar specs and their errors, the compile cache, the mask's rules (EOS
allowed exactly when the grammar accepts; rollback restores the mask), the decode loop and the engine on
the shipped model (every finished answer valid against its schema, greedy and at temperature 1; batched ==
alone with a schema on, n > 1, chunked prefill and preemption included)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvlab
from kvlab import Engine, SamplingParams
from kvlab.errors import InputError
from kvlab.generation.generate import stream_generate
from kvlab.sampling.grammar import (GRAMMAR_CACHE, GrammarSpec, allocate_bitmask, compile_grammar, grammar_vocab,
                                    mask_logits)
from kvlab.tokenizer import ByteTokenizer

# The schemas of the issue's goal: enums, nested objects, arrays with bounds, integer ranges, anyOf.
SCHEMAS = {
    "enum": {"type": "object", "properties": {"mood": {"enum": ["merry", "sad", "wroth"]}},
             "required": ["mood"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["speaker", "line"], "properties": {
        "speaker": {"type": "object", "additionalProperties": False, "required": ["name", "rank"],
                    "properties": {"name": {"type": "string", "maxLength": 12},
                                   "rank": {"enum": ["king", "lord", "fool"]}}},
        "line": {"type": "string", "maxLength": 24}}},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 2, "maxItems": 4},
    "ranges": {"type": "object", "additionalProperties": False, "required": ["age", "debt"],
               "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                              "debt": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "anyof": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3},
                        {"type": "object", "additionalProperties": False, "required": ["word"],
                         "properties": {"word": {"type": "string", "maxLength": 8}}}]},
}
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "KING HENRY:"]


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer = kvlab.load()
    return model, tokenizer


@pytest.fixture(scope="module")
def vocab(shipped):
    model, tokenizer = shipped
    return grammar_vocab(tokenizer, model.config.vocab_size, tokenizer.eos_token_ids)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """A mask row as [vocab] bools."""
    return np.unpackbits(np.ascontiguousarray(bitmask_row).view(np.uint8), bitorder="little")[:vocab_size] \
        .astype(bool)


def compiled(vocab, schema):
    return compile_grammar(GrammarSpec.json_schema(schema), vocab)


# --- specs, errors, the cache ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: GrammarSpec.json_schema({"type": "foo"}), "invalid JSON schema"),
    (lambda: GrammarSpec.json_schema('{"type": '), "not valid JSON"),
    (lambda: GrammarSpec.json_schema([1, 2]), "must be an object"),
    (lambda: GrammarSpec.regex("a(b"), "invalid regex"),
    (lambda: GrammarSpec.regex(""), "non-empty"),
    (lambda: GrammarSpec.choice([]), "non-empty list"),
    (lambda: GrammarSpec.choice("yes"), "non-empty list"),
    (lambda: GrammarSpec.grammar("root ::= undefined-rule"), "invalid grammar"),
    (lambda: GrammarSpec.grammar("start: nothing_here"), "invalid grammar"),
    (lambda: GrammarSpec("yaml", "x"), "unknown grammar kind"),
    (lambda: GrammarSpec.regex("a" * 300_000), "at most"),
])
def test_bad_specs_are_refused_before_a_vocabulary_is_needed(make, message):
    with pytest.raises(InputError, match=message):
        make().check()


def test_a_grammar_past_the_limits_fails_fast_with_llguidance_s_message(vocab):
    """A grammar bigger than LIMIT_VALUES' max_grammar_size is refused at compile time, not mid-answer."""
    spec = GrammarSpec.grammar("start: " + " | ".join(f'"w{i}" x' for i in range(20000)) + '\nx: "a" | "b"')
    with pytest.raises(InputError, match="invalid grammar: .*too big"):
        compile_grammar(spec, vocab)
    with pytest.raises(InputError, match="too big"):
        spec.check()


def test_a_deep_rule_chain_compiles_instead_of_overflowing_the_stack(vocab):
    """llguidance recurses over rule chains; 3,000 rules crashed an 8 MiB stack. The compile thread's stack
    holds the longest chain MAX_GRAMMAR_CHARS admits."""
    chain = "start: r0\n" + "\n".join(f'r{i}: "w" r{i + 1}?' for i in range(9000)) + '\nr9000: "z"'
    compile_grammar(GrammarSpec.grammar(chain), vocab)


def test_equal_schemas_compile_once(vocab):
    a = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = GrammarSpec.json_schema('{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a == b  # canonical text: key order does not matter
    misses = GRAMMAR_CACHE.misses
    assert compile_grammar(a, vocab) is compile_grammar(b, vocab)
    assert GRAMMAR_CACHE.misses <= misses + 1


def test_sampling_params_refuse_what_would_cut_a_structured_answer(vocab):
    grammar = compiled(vocab, SCHEMAS["enum"])
    for bad in ({"ignore_eos": True}, {"stop": ("}",)}, {"stop_token_ids": (5,)}):
        with pytest.raises(InputError, match="structured output"):
            SamplingParams(grammar=grammar, **bad)
    with pytest.raises(InputError, match="CompiledGrammar"):
        SamplingParams(grammar='{"type": "object"}')


# --- the mask --------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(schema=st.sampled_from(sorted(SCHEMAS)), picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=40),
       back=st.integers(1, 5))
def test_eos_is_allowed_exactly_when_the_grammar_accepts_and_rollback_restores_the_mask(vocab, schema, picks,
                                                                                         back):
    matcher = compiled(vocab, SCHEMAS[schema]).matcher()
    eos = vocab.eos_ids[0]
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    masks = []
    for pick in picks:
        matcher.fill_mask(bitmask, 0)
        allowed = allowed_tokens(bitmask[0], vocab.vocab_size)
        masks.append(allowed.copy())
        assert allowed[eos] == matcher.is_accepting()
        choices = np.flatnonzero(allowed)
        choices = choices[choices != eos]
        if choices.size == 0:
            break
        assert matcher.advance(int(choices[pick % choices.size]))
    consumed = len(masks) - (1 if choices.size == 0 else 0)
    k = min(back, consumed)
    if k:
        assert matcher.rollback(k)
        matcher.fill_mask(bitmask, 0)
        assert np.array_equal(allowed_tokens(bitmask[0], vocab.vocab_size), masks[consumed - k])


def test_mask_logits_forbids_exactly_the_masked_tokens(vocab):
    grammar = compile_grammar(GrammarSpec.choice(["yes", "no"]), vocab)
    logits = np.random.default_rng(0).standard_normal((3, vocab.vocab_size)).astype(np.float32)
    out = mask_logits(logits, [grammar.matcher(), None, grammar.matcher()])
    assert np.array_equal(out[1], logits[1]) and not np.shares_memory(out, logits)
    for row in (0, 2):
        finite = np.isfinite(out[row])
        assert 0 < finite.sum() < vocab.vocab_size
        assert np.array_equal(out[row][finite], logits[row][finite])


def test_the_byte_tokenizer_vocabulary_works_too():
    model = kvlab.TinyLlama(seed=3)
    tok = ByteTokenizer()
    vocab = grammar_vocab(tok, model.config.vocab_size, tok.eos_token_ids)
    grammar = compile_grammar(GrammarSpec.regex("[0-9]{3}-[a-z]{2}"), vocab)
    loop = stream_generate(model, [tok.encode("x")], 20, stop_token_ids=tok.eos_token_ids, grammar=grammar)
    tokens = [int(t[0]) for t in loop]
    assert tokens[-1] == tok.eos_token_id and loop.reason.finish_reason == "stop"
    import re
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", tok.decode(tokens))


# --- answers on the shipped model -----------------------------------------------------------------------------
def _answers(outputs):
    return [(c.text, c.finish_reason) for out in outputs for c in out.outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_finished_answer_is_valid_against_its_schema(shipped, vocab, temperature):
    """The goal: 100 % of finished answers parse and validate, over every schema, greedy and sampled."""
    model, tokenizer = shipped
    engine = Engine(model, tokenizer, block_size=16)
    finished, total = 0, 0
    for name, schema in SCHEMAS.items():
        params = SamplingParams(temperature=temperature, seed=11, n=3 if temperature else 1, max_tokens=64,
                                grammar=compiled(vocab, schema))
        for text, reason in _answers(engine.generate(PROMPTS, params)):
            total += 1
            assert reason in ("stop", "length"), (name, text, reason)
            if reason == "stop":
                finished += 1
                jsonschema.validate(json.loads(text), schema)
            else:  # cut by max_tokens: says length, and its text is a prefix the grammar still accepts
                assert text
    assert finished >= total // 2, f"only {finished} of {total} answers finished"


def test_the_decode_loop_and_the_engine_give_the_same_structured_answer(shipped, vocab):
    model, tokenizer = shipped
    grammar = compiled(vocab, SCHEMAS["nested"])
    prompt = tokenizer.encode(PROMPTS[0])
    loop = stream_generate(model, [prompt], 64, stop_token_ids=tokenizer.eos_token_ids, grammar=grammar)
    looped = [int(t[0]) for t in loop]
    [out] = Engine(model, tokenizer, block_size=16).generate([prompt], SamplingParams(max_tokens=64, grammar=grammar))
    assert out.outputs[0].token_ids == looped


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_equals_alone_with_a_schema_on(vocab, temperature):
    """Invariant 9 with grammars: a request's tokens do not depend on its company, chunking or preemption."""
    model, tokenizer = kvlab.load(dtype="float64")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(temperature=temperature, seed=5 + i, n=2, max_tokens=40,
                             grammar=compiled(vocab, SCHEMAS[name]))
              for i, name in enumerate(["nested", "array", "anyof"])]
    alone = [Engine(model, tokenizer, block_size=4).generate([p], q)[0] for p, q in zip(prompts, params)]
    tight = Engine(model, tokenizer, block_size=4, num_blocks=14, max_num_batched_tokens=7)
    together = tight.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in together] == [[c.token_ids for c in o.outputs] for o in alone]
    assert tight.scheduler.num_preemptions > 0  # the schedule did differ
