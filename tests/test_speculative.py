"""Speculative decoding (kvlab/engine/speculative.py): the text with speculation is the text without it, for
greedy and seeded sampling, alone and batched, under policies and sliding windows, with quantized caches;
rejected rows never become visible (pool balanced, nothing rejected in the prefix cache); bad configs name
their field."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvlab
from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.engine.speculative import MAX_PAUSE, SpeculativeConfig, accept, adapt, ngram_lookup
from kvlab.errors import ConfigError
from kvlab.hf import DEFAULT_MODEL_DIR

MODEL = TinyLlama(seed=5)  # float64
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repetitive(i: int, n: int) -> list[int]:
    """Prompts that repeat themselves (so lookup finds guesses), different per i."""
    motif = [(13 * i + 7 * t) % 250 + 3 for t in range(5 + i % 3)]
    return (motif * (n // len(motif) + 1))[:n]


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    outs = engine.generate(prompts, params)
    pool = engine.block_pool
    pool.check_invariants()
    assert pool.num_used_blocks == 0
    return [[c.token_ids for c in out.outputs] for out in outs]


# --- the config, as vLLM spells it -------------------------------------------------------------------------
@pytest.mark.parametrize("spec, field", [
    ('{"method": "ngram"', "JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/model"}', "does not exist"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ('[1, 2]', "JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
])
def test_a_bad_speculative_config_is_refused_naming_the_field(spec, field):
    with pytest.raises(ConfigError, match=field):
        Engine(MODEL, speculative_config=spec)


def test_the_config_reads_vllm_spelling():
    config = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == ("ngram", 4, 3, 1)
    assert SpeculativeConfig.parse(None) is None
    assert config.disable_by_batch_size is None  # vLLM's default: speculate at every batch size
    assert SpeculativeConfig.parse({**NGRAM, "disable_by_batch_size": 4}).disable_by_batch_size == 4


def test_no_guesses_while_disable_by_batch_size_sequences_run(monkeypatch):
    """Three requests of different lengths, limit 2: no sequence gets a guess while two or more run, the last
    one alone does; the text is plain decoding's either way."""
    import kvlab.engine.speculative as speculative

    running_when_guessing = []
    propose = speculative.Speculator.propose

    def watched(self, seq):
        running_when_guessing.append(len(engine.scheduler.running))
        propose(self, seq)

    monkeypatch.setattr(speculative.Speculator, "propose", watched)
    prompts = [repetitive(i, 30) for i in range(3)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 8, 40)]
    engine = Engine(MODEL, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    assert run(engine, prompts, params) == run(Engine(MODEL), prompts, params)
    assert running_when_guessing and max(running_when_guessing) == 1
    assert engine.stats()["spec_decode_num_drafts"] > 0  # the last request, alone, speculated


# --- the pieces ---------------------------------------------------------------------------------------------
def test_ngram_lookup_takes_the_most_recent_longest_match():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_lookup(ids, 3, 3, 1) == [7, 8, 5]  # "1 2 3" last seen before 7 8 5
    assert ngram_lookup(ids, 1, 3, 1) == [7]
    assert ngram_lookup([4, 5, 6], 3, 3, 1) == []     # nothing repeats
    assert ngram_lookup([4, 5, 4], 2, 2, 1) == [5, 4]  # n=2 misses, n=1 finds "4"
    assert ngram_lookup([4, 5, 4], 2, 2, 2) == []     # ... unless n=1 is below the minimum
    assert ngram_lookup([7], 3, 3, 1) == []


def test_accept_draws_once_per_emitted_token_and_stops_at_the_first_disagreement():
    rows = np.eye(6)[[2, 3, 4, 5]]  # argmax per row: 2, 3, 4, 5
    calls = []

    def draw(row):
        calls.append(1)
        return int(np.argmax(row))

    result = accept([2, 3, 9], rows, draw)
    assert (result.tokens, result.num_accepted, len(calls)) == ([2, 3, 4], 2, 3)
    calls.clear()
    result = accept([2, 3, 4], rows, draw)  # all kept: the last row gives a bonus token
    assert (result.tokens, result.num_accepted, len(calls)) == ([2, 3, 4, 5], 3, 4)


def test_adapt_backs_off_when_nothing_is_kept_and_grows_back():
    assert adapt(4, 4, 4, 0) == (2, 0, 0) and adapt(2, 4, 2, 0) == (1, 0, 0)
    assert adapt(2, 4, 2, 2) == (3, 0, 0) and adapt(4, 4, 4, 4) == (4, 0, 0)
    assert adapt(3, 4, 3, 1, misses=2) == (3, 0, 0)  # a guess kept: the misses are forgotten
    assert adapt(3, 4, 0, 0, misses=2) == (3, 0, 2)  # nothing guessed: nothing learnt


def test_a_rejected_single_guess_sits_out_steps_doubling_up_to_max_pause():
    k, misses, pauses = 1, 0, []
    for _ in range(7):
        k, pause, misses = adapt(k, 4, 1, 0, misses)
        pauses.append(pause)
    assert k == 1 and pauses == [1, 2, 4, 8, 16, 16, 16] and MAX_PAUSE == 16
    assert adapt(1, 4, 1, 1, misses) == (2, 0, 0)  # kept: no pause, and the next miss sits out one step


# --- the text is plain decoding's -------------------------------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 6), block_size=st.sampled_from([1, 2, 4, 16]), chunk=st.integers(4, 32),
       lengths=st.lists(st.integers(2, 40), min_size=1, max_size=4), new=st.integers(1, 24),
       sampled=st.booleans(), n=st.sampled_from([1, 1, 2]), prefix_caching=st.booleans(),
       policy=st.sampled_from([None, "window:12", "sinks:2:10", "shift:1:14"]),
       kv_dtype=st.sampled_from([None, "int8"]), tight=st.booleans())
def test_speculation_emits_plain_decodings_tokens(k, block_size, chunk, lengths, new, sampled, n, prefix_caching,
                                                  policy, kv_dtype, tight):
    if policy is not None:
        # a policy's keep depends on the chunk schedule, which company changes (speculation or not: a
        # decode's guesses take budget a neighbour's prefill chunk would have had), so one request at a time
        lengths = lengths[:1]
    prompts = [repetitive(i, length) for i, length in enumerate(lengths)]
    params = [SamplingParams(max_tokens=new, n=n, ignore_eos=True, **(dict(temperature=0.9, seed=11 + i)
                                                                      if sampled else {}))
              for i in range(len(prompts))]
    settings_ = dict(block_size=block_size, max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching,
                     kv_policy=policy, kv_cache_dtype=kv_dtype, max_num_seqs=4)
    if tight:  # preemption and recompute mid-speculation
        settings_["num_blocks"] = -(-(max(lengths) + new + k + 1) // block_size) + 1 + (policy is not None) * 2
    try:
        plain = Engine(MODEL, **settings_)
    except ConfigError:
        return
    spec = Engine(MODEL, speculative_config={**NGRAM, "num_speculative_tokens": k}, **settings_)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert spec.counters.num_computed_tokens >= plain.counters.num_computed_tokens - sum(lengths) * n


def test_speculation_saves_steps_on_a_copy_and_counts_what_it_kept():
    prompt = repetitive(0, 60)
    plain, spec = Engine(MODEL), Engine(MODEL, speculative_config=NGRAM)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert run(spec, [prompt], [params]) == run(plain, [prompt], [params])
    stats = spec.stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert spec.counters.num_steps < plain.counters.num_steps


def test_rejected_rows_never_reach_the_prefix_cache():
    """Every block the speculating engine registered holds the K/V full recompute gives for its tokens: a
    request served from those blocks gets full recompute's logits."""
    prompt = repetitive(1, 30)
    engine = Engine(MODEL, block_size=4, speculative_config={**NGRAM, "num_speculative_tokens": 6})
    first = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    tokens = prompt + first.outputs[0].token_ids
    assert engine.stats()["spec_decode_num_draft_tokens"] > engine.stats()["spec_decode_num_accepted_tokens"]
    again = engine.generate([tokens], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert again.num_cached_tokens >= len(tokens) - 4
    expected = int(MODEL.forward([tokens]).logits[0, -1].argmax())
    assert again.outputs[0].token_ids == [expected]


def test_an_abort_mid_speculation_leaves_the_pool_balanced():
    engine = Engine(MODEL, block_size=2, speculative_config=NGRAM)
    engine.add_request("a", repetitive(2, 20), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", repetitive(3, 20), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used_blocks == 0


def test_guesses_never_outgrow_the_pool_which_ends_the_text_as_plain_decoding_does():
    """A sequence that outgrows a small pool ends with "length" where plain decoding ends it: guesses that
    would need more blocks than the whole pool holds are not made (they made a lone sequence raise the
    scheduler's liveness error)."""
    prompt = [7, 19, 33, 41, 58] * 2
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    guessed = 0
    for num_blocks in range(3, 9):
        plain = Engine(MODEL, block_size=4, num_blocks=num_blocks).generate([prompt], params)[0].outputs[0]
        assert plain.finish_reason == "length" and len(prompt) + len(plain.token_ids) == num_blocks * 4 + 1
        spec = Engine(MODEL, block_size=4, num_blocks=num_blocks, speculative_config=NGRAM)
        got = spec.generate([prompt], params)[0].outputs[0]
        assert (got.token_ids, got.finish_reason) == (plain.token_ids, plain.finish_reason), num_blocks
        guessed += spec.stats()["spec_decode_num_draft_tokens"]
        spec.block_pool.check_invariants()
        assert spec.block_pool.num_used_blocks == 0
    assert guessed > 0


def test_a_stop_token_inside_the_accepted_guesses_ends_the_text_there():
    prompt = repetitive(4, 30)
    plain = Engine(MODEL).generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = plain.token_ids[12]
    params = SamplingParams(max_tokens=30, stop_token_ids=[stop], ignore_eos=True)
    expected = Engine(MODEL).generate([prompt], params)[0].outputs[0]
    spec = Engine(MODEL, speculative_config=NGRAM)
    got = spec.generate([prompt], params)[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
    spec.block_pool.check_invariants()
    assert spec.block_pool.num_used_blocks == 0


# --- the compiled path: verified rows are one-token steps' rows --------------------------------------------
@pytest.mark.parametrize("kv_dtype", [None, "float16", "int8"])
def test_each_verified_row_has_the_logits_of_a_one_token_step(kv_dtype):
    """On the shipped model (float32, compiled kernels), rows 1..k+1 of a verification forward equal, bit for
    bit, the logits plain decoding computes one token at a time (within the kernels' fused-row limit)."""
    model, tokenizer = kvlab.load()
    prompt = tokenizer.encode("ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft,")
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    plain = Engine(model, tokenizer, kv_cache_dtype=kv_dtype).generate([prompt], greedy)[0].outputs[0]
    spec_engine = Engine(model, tokenizer, kv_cache_dtype=kv_dtype,
                         speculative_config={**NGRAM, "num_speculative_tokens": 5})
    spec = spec_engine.generate([prompt], greedy)[0].outputs[0]
    assert spec_engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert spec.token_ids == plain.token_ids
    assert spec.logprobs == plain.logprobs  # every kept row's log-probabilities, bit for bit


# --- the draft model ----------------------------------------------------------------------------------------
def test_a_draft_model_with_the_targets_tokenizer_gives_the_same_text(tmp_path):
    model, tokenizer = kvlab.load()
    path = tmp_path / "draft"
    shutil.copytree(DEFAULT_MODEL_DIR, path)  # the same weights: every guess is kept, a clean check
    prompt = tokenizer.encode("JULIET: O Romeo, Romeo, wherefore art thou Romeo?")
    params = [SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(max_tokens=24, temperature=0.8, seed=5)]
    plain = [o.outputs[0].token_ids for o in Engine(model, tokenizer).generate([prompt, prompt], params)]
    engine = Engine(model, tokenizer, speculative_config={"method": "draft_model", "model": str(path),
                                                          "num_speculative_tokens": 3})
    greedy = engine.generate([prompt], params[:1])[0].outputs[0].token_ids
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0  # same weights
    got = [o.outputs[0].token_ids for o in engine.generate([prompt, prompt], params)]
    assert [greedy] + got[1:] == got == plain  # the sampled one's guesses (greedy) are often rejected
    # the draft sits out the steps where two run, then catches up on the tokens it missed
    short = [SamplingParams(max_tokens=5, ignore_eos=True), params[0]]
    paused = Engine(model, tokenizer, speculative_config={"method": "draft_model", "model": str(path),
                                                          "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    assert [o.outputs[0].token_ids for o in paused.generate([prompt, prompt], short)][1] == plain[0]
    assert paused.stats()["spec_decode_num_accepted_tokens"] == paused.stats()["spec_decode_num_draft_tokens"] > 0


def test_a_draft_model_with_another_tokenizer_is_refused_naming_it(tmp_path):
    model, tokenizer = kvlab.load()
    path = tmp_path / "draft"
    shutil.copytree(DEFAULT_MODEL_DIR, path)
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="another tokenizer"):
        Engine(model, tokenizer, speculative_config={"method": "draft_model", "model": str(path),
                                                     "num_speculative_tokens": 3})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_under_a_json_schema_gives_the_same_valid_answer(temperature):
    """Guesses are checked against the grammar's mask: each kept token is drawn from the masked row, and the
    matcher only ever consumes kept tokens; the answer is the one plain decoding gives."""
    from kvlab.sampling.grammar import GrammarSpec, compile_grammar, grammar_vocab

    model, tokenizer = kvlab.load()
    vocab = grammar_vocab(tokenizer, model.config.vocab_size, tokenizer.eos_token_ids)
    schema = {"type": "object", "additionalProperties": False, "required": ["speaker", "mood"],
              "properties": {"speaker": {"enum": ["ROMEO", "JULIET", "MERCUTIO"]},
                             "mood": {"enum": ["merry", "sad", "wroth"]}}}
    grammar = compile_grammar(GrammarSpec.json_schema(schema), vocab)
    prompt = tokenizer.encode('{"speaker":"ROMEO","mood":"sad"}\n{"speaker":"JULIET","mood":"merry"}\n'
                              '{"speaker":"ROMEO","mood":"sad"}\n')
    params = [SamplingParams(max_tokens=40, temperature=temperature, seed=i, grammar=grammar) for i in range(4)]
    plain = [o.outputs[0] for o in Engine(model, tokenizer).generate([prompt] * 4, params)]
    spec_engine = Engine(model, tokenizer, speculative_config={**NGRAM, "num_speculative_tokens": 5})
    spec = [o.outputs[0] for o in spec_engine.generate([prompt] * 4, params)]
    assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]
    assert spec_engine.stats()["spec_decode_num_accepted_tokens"] > 0
    for out in spec:
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"speaker", "mood"}


@pytest.mark.parametrize("chunk, k", [(2, 6), (3, 1), (4, 2), (5, 3), (8, 6)])
def test_guesses_take_the_steps_token_budget_like_any_token(chunk, k):
    """A decode's guesses ride in the step's token budget (max_num_batched_tokens): with three sequences
    decoding side by side, no step computes more rows than the budget, guesses included; a sequence left
    with room for its next token only runs that token (never a guess in its place: k = chunk - 2 leaves
    the second sequence one row after the first's guesses), so the tokens are plain decoding's; and guesses
    were made. Bounded in steps: a wrong budget fails, never hangs."""
    prompts = [repetitive(i, 2 * chunk) for i in range(3)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = []
    for speculative in (None, {**NGRAM, "num_speculative_tokens": k}):
        engine = Engine(MODEL, speculative_config=speculative, max_num_batched_tokens=chunk, max_num_seqs=3)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        widest, done = 0, {}
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            before = engine.counters.num_computed_tokens
            done.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
            widest = max(widest, engine.counters.num_computed_tokens - before)
        assert not engine.has_unfinished_requests() and widest == chunk
        outputs.append(done)
    assert outputs[1] == outputs[0] and len(outputs[0]) == 3
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0
