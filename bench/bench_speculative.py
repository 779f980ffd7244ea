"""Speculative decoding on the shipped model: plain decode vs prompt lookup (ngram) vs a draft model, side by side.

Four kinds of prompt (each in 8 variants, cut from Shakespeare lines so the model has seen the words):
  * copy: a passage, then the passage again, started: the continuation repeats text in the prompt;
  * code edit: a short Python function, then "the same function, renamed", started;
  * quote summary: a passage, then a summary that quotes it, started on the quote;
  * free text: a short opening line, continued freely (what prompt lookup cannot guess).
Three modes, each its own Engine (prefix caching off, so every run prefills): plain; ngram
({"method": "ngram", "num_speculative_tokens": K}); draft ({"method": "draft_model"} with a Q8_0 GGUF copy of the
same model written by `kvlab quantize`). Batch 1 (one prompt at a time) and batch 8 (the 8 variants in one
`generate`). Greedy, --tokens new tokens per request (ignore_eos, so every mode emits the same count; the
texts are checked equal across modes). Rounds alternate the modes; each mode's tokens/s is the generated
tokens over the wall time of its `generate` calls (prefill included), and the ratio to plain is the median
of the per-round ratios. Acceptance = accepted guesses / guesses, from the engine's spec_decode counters.

With --model FILE.gguf and llama.cpp's binaries (--llama-cpp-bin DIR, or $LLAMA_CPP_BIN), each round also runs
llama.cpp on the same file and the same batch-1 prompts (the chat template rendered by kvlab, passed raw):
`llama-lookup` (its prompt lookup decoding, --spec-draft-n-max K) and the same binary with drafting off (its
plain decode), greedy, the same new-token count, --threads threads, one process per prompt
(bench/llama_cpp_lookup.py says how its guessing differs from vLLM's ngram). Its tok/s is llama.cpp's own
prefill + decode time (model load excluded), the ratio the median of per-round ratios as for kvlab; llama-lookup
has no batching, so batch 8 has no llama.cpp cells. The text check reports how many of kvlab's first greedy
tokens llama.cpp's plain decode reproduces (different kernels: they agree until two logits nearly tie).

    python bench/bench_speculative.py [--rounds 5] [--tokens 96] [--k 5] [--threads 1] [--quick] [--prompts 8]
    python bench/bench_speculative.py --model SmolLM2-135M-Instruct.Q4_1.gguf   # an instruct model, chat prompts
    python bench/bench_speculative.py --model SmolLM2-135M-Instruct.Q4_1.gguf --llama-cpp-bin LLAMA_CPP/build/bin

Writes bench/out/bench_speculative.json. The machine may be shared: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp_lookup

OUT = Path(__file__).resolve().parent / "out"

LINES = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "Now is the winter of our discontent made glorious summer by this sun of York",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him",
    "All the world's a stage, and all the men and women merely players; they have their exits",
    "If music be the food of love, play on; give me excess of it, that, surfeiting",
    "O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name",
    "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day",
    "The quality of mercy is not strained; it droppeth as the gentle rain from heaven",
]
NAMES = ["speak", "answer", "greet", "rule", "crown", "mourn", "jest", "pardon"]
OPENINGS = ["The king", "Enter a messenger", "My lord,", "What news?", "Good morrow,", "Alas,", "Come,",
            "Hark!"]


def prompts(kind: str) -> list[str]:
    if kind == "copy":
        return [f"{line}.\n{line}.\n{line[:len(line) // 3]}" for line in LINES]
    if kind == "code edit":
        out = []
        for name, line in zip(NAMES, LINES):
            body = (f"def {name}(lord, lady):\n    line = \"{line[:40]}\"\n    if lord:\n        return line\n"
                    f"    return lady + line\n")
            out.append(f"{body}\n# the same function, renamed\ndef {name}_again(lord, lady):\n    line = \"")
        return out
    if kind == "quote summary":
        return [f"{line}; so spoke the player.\nIn short, the player said: \"{line[:len(line) // 4]}"
                for line in LINES]
    return list(OPENINGS)


KINDS = ["copy", "code edit", "quote summary", "free text"]


def chat_requests(kind: str) -> list[str]:
    """The same four kinds as user messages for an instruct model (--model): copy the passage, rewrite the
    function renamed, summarise quoting the passage, write freely. Each passage (five lines, ~100 tokens) and
    function is about as long as the answer's --tokens (96), so a copy-heavy answer copies for most of its
    length (with two-line passages the model copied ~40 tokens, then wrote freely: a mixed task)."""
    passages = [".\n".join(LINES[(i + j) % len(LINES)] for j in range(5)) + "." for i in range(len(LINES))]
    if kind == "copy":
        return [f"Repeat the following text exactly, word for word:\n\n{p}" for p in passages]
    if kind == "code edit":
        return [f"Rewrite this Python function with its name changed to {name}_again, everything else the same:"
                f"\n\ndef {name}(lord, lady, court=None):\n    line = \"{line[:40]}\"\n    if court is not None:\n"
                f"        court.append(line)\n    if lord:\n        return line.upper()\n"
                f"    for word in line.split():\n        lady = lady + word[::-1]\n    return lady + line\n"
                for name, line in zip(NAMES, LINES)]
    if kind == "quote summary":
        return [f"Summarize this passage in one sentence, then quote it in full:\n\n{p}" for p in passages]
    return [f"Write a short story that begins: {opening}" for opening in OPENINGS]


def llama_cpp_setup(args: argparse.Namespace) -> tuple[Path | None, str]:
    """llama-lookup's path when this run compares with llama.cpp, else None; and the note that says which."""
    if not args.model or not args.model.endswith(".gguf"):
        return None, "llama.cpp: skipped (it needs --model FILE.gguf)"
    binary = llama_cpp_lookup.find_binary(args.llama_cpp_bin)
    if binary is None:
        where = args.llama_cpp_bin or "no --llama-cpp-bin and no $LLAMA_CPP_BIN"
        return None, f"llama.cpp: skipped ({llama_cpp_lookup.BINARY} not found: {where})"
    return binary, (f"llama.cpp: {binary} on the same file, batch 1 only; plain = --spec-draft-n-max 0, lookup = "
                    f"--spec-draft-n-max {args.k} (n-grams 1..4); tok/s over its prefill + decode; its text vs "
                    f"kvlab's plain greedy text, per prompt kind:")


def llama_prompts(tokenizer, model: Path) -> dict[str, list[str]]:
    """The chat prompts as text, rendered by kvlab's template as `encode_chat` renders them. llama.cpp parses
    the special tokens in them; when the file tells it to add a BOS itself, a BOS the template wrote is cut
    off here so it is not doubled."""
    from kvlab.gguf.reader import read_gguf

    add_bos = bool(read_gguf(model).metadata.get("tokenizer.ggml.add_bos_token", False))
    bos = tokenizer.decode([tokenizer.bos_token_id], skip_special_tokens=False) if tokenizer.bos_token_id is not None \
        else None
    out = {}
    for kind in KINDS:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], True) for p in chat_requests(kind)]
        out[kind] = [t[len(bos):] if add_bos and bos and t.startswith(bos) else t for t in texts]
    return out


def same_text(a: str, b: str) -> bool:
    """Equal on their common length: llama-lookup's accepted guesses may run a few tokens past -n."""
    return a.startswith(b) or b.startswith(a)


def llama_row(kind: str, rates: dict[str, list[float]], counts: dict[tuple[str, str], list[int]],
              runs: dict[tuple[str, str], list]) -> dict:
    """The llama.cpp cells of one batch-1 row: tok/s (prefill + decode, the median round), the lookup/plain
    ratio (median of per-round ratios), acceptance, and decode-only tok/s as llama.cpp prints it."""
    row = {}
    for mode in ("plain", "lookup"):
        tokens, drafted, kept, decode_us = counts[(kind, mode)]
        row[f"llama_{mode}_tok_s"] = statistics.median(rates[mode])
        row[f"llama_{mode}_decode_tok_s"] = tokens / (decode_us / 1e6)
        row[f"llama_{mode}_prompt_tokens"] = [r.prompt_tokens for r in runs[(kind, mode)]]
    tokens, drafted, kept, _ = counts[(kind, "lookup")]
    row["llama_lookup_ratio"] = statistics.median(s / p for p, s in zip(rates["plain"], rates["lookup"]))
    row["llama_lookup_acceptance"] = kept / drafted if drafted else None
    row["llama_lookup_drafted_per_token"] = drafted / tokens
    row["llama_lookup_same_text_as_plain"] = [same_text(a.text, b.text) for a, b in
                                              zip(runs[(kind, "lookup")], runs[(kind, "plain")])]
    return row


def llama_agreement(tokenizer, ids: dict[str, list[list[int]]], texts: dict, runs: dict) -> dict[str, str]:
    """Per prompt kind: how many of kvlab's first greedy tokens (batch 1, plain, up to its first end-of-turn
    token, which llama.cpp's --ignore-eos bans) llama.cpp's plain text reproduces, per prompt; whether
    llama.cpp tokenized each prompt to as many tokens as kvlab; whether llama-lookup's text equals llama.cpp's
    plain text."""
    stops = set(tokenizer.eos_token_ids)
    out = {}
    for kind in KINDS:
        plain, spec = runs[(kind, "plain")], runs[(kind, "lookup")]
        agree = []
        for kv_ids, run in zip(texts[(kind, 1, "plain")], plain):
            kv_ids = list(kv_ids)
            cut = next((i for i, t in enumerate(kv_ids) if t in stops), len(kv_ids))
            n = 0
            while n < cut and run.text.startswith(tokenizer.decode(kv_ids[:n + 1], skip_special_tokens=False)):
                n += 1
            agree.append(f"{n}/{cut}")
        same_prompt = sum(r.prompt_tokens == len(p) for r, p in zip(plain, ids[kind]))
        same = sum(same_text(a.text, b.text) for a, b in zip(spec, plain))
        out[kind] = (f"first tokens agreeing {' '.join(agree)}; prompt token counts equal {same_prompt}/{len(plain)}; "
                     f"llama-lookup text == its plain text {same}/{len(plain)}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per request (default 96)")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens for ngram (default 5)")
    parser.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens for the draft (default 3)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 48 tokens (a smoke run)")
    parser.add_argument("--model", help="an instruct model (HF folder or .gguf) asked through its chat template "
                                        "instead of the shipped model")
    parser.add_argument("--draft", help="the draft model for --model (default: none, no draft column); the "
                                        "shipped model's draft is its own Q8_0 copy")
    parser.add_argument("--disable-by-batch-size", type=int, default=4,
                        help="the 'ngram-off' mode: ngram with disable_by_batch_size N (default 4)")
    parser.add_argument("--prompts", type=int, default=8, choices=range(1, 9), metavar="1..8",
                        help="prompts per kind, also the larger batch (default 8; fewer for a smoke run)")
    parser.add_argument("--llama-cpp-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                        help="llama.cpp's build/bin folder: with --model FILE.gguf, llama-lookup and its plain "
                             "decode side by side (default $LLAMA_CPP_BIN; without it, skipped with a note)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 2, 48
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    lookup, llama_note = llama_cpp_setup(args)
    if not lookup:
        print(llama_note, file=sys.stderr)

    import kvlab
    from kvlab import Engine, SamplingParams
    from kvlab.hf import DEFAULT_MODEL_DIR

    model, tokenizer = kvlab.load(args.model) if args.model else kvlab.load()
    draft = args.draft
    if not args.model:
        draft = str(Path(tempfile.mkdtemp(prefix="kvlab-bench-spec-")) / "draft-q8_0.gguf")
        subprocess.run([sys.executable, "-m", "kvlab", "quantize", "--type", "q8_0", str(DEFAULT_MODEL_DIR), draft],
                       check=True, capture_output=True)
    configs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        "ngram-off": {"method": "ngram", "num_speculative_tokens": args.k,
                      "disable_by_batch_size": args.disable_by_batch_size},
    }
    if draft:
        configs["draft"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.draft_k}
    engines = {mode: Engine(model, tokenizer, speculative_config=spec, enable_prefix_caching=False, max_num_seqs=8)
               for mode, spec in configs.items()}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    if args.model:
        ids = {kind: [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in chat_requests(kind)]
               for kind in KINDS}
    else:
        ids = {kind: [tokenizer.encode(p) for p in prompts(kind)] for kind in KINDS}
    ids = {kind: group[:args.prompts] for kind, group in ids.items()}
    batches = sorted({1, args.prompts})
    context = model.config.max_position_embeddings
    for kind, group in ids.items():
        assert max(len(p) for p in group) + args.tokens <= context, (kind, max(len(p) for p in group))
    for engine in engines.values():  # warm-up: compile or load every kernel a run will call
        engine.generate(ids["copy"][:2], params)
    llama_texts = llama_prompts(tokenizer, Path(args.model)) if lookup else {}
    llama_rates: dict[str, dict[str, list[float]]] = {}  # kind -> "plain"/"lookup" -> per-round tokens/s
    llama_counts: dict[tuple[str, str], list[int]] = {}     # (kind, mode) -> [tokens, drafted, accepted, decode us]
    llama_runs: dict[tuple[str, str], list[llama_cpp_lookup.LookupRun]] = {}

    # (kind, batch) -> mode -> per-round seconds and tokens; acceptance counters per mode
    seconds: dict[tuple[str, int], dict[str, list[float]]] = {}
    counts: dict[tuple[str, int, str], list[int]] = {}
    texts: dict[tuple[str, int, str], list[list[int]]] = {}
    for rnd in range(args.rounds):
        for kind in KINDS:
            for batch in batches:
                order = list(configs) if rnd % 2 == 0 else list(reversed(configs))  # alternate who goes first
                for mode in order:
                    engine = engines[mode]
                    before = engine.stats()
                    start = time.perf_counter()
                    if batch == 1:
                        outs = [engine.generate([p], params)[0] for p in ids[kind]]
                    else:
                        outs = engine.generate(ids[kind], params)
                    elapsed = time.perf_counter() - start
                    after = engine.stats()
                    seconds.setdefault((kind, batch), {}).setdefault(mode, []).append(elapsed)
                    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                    kept = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                    c = counts.setdefault((kind, batch, mode), [0, 0])
                    c[0] += drafted
                    c[1] += kept
                    texts[(kind, batch, mode)] = [o.outputs[0].token_ids for o in outs]
            if lookup:
                for mode in (("plain", "lookup") if rnd % 2 == 0 else ("lookup", "plain")):
                    runs = [llama_cpp_lookup.run_lookup(
                        lookup, Path(args.model), text, tokens=args.tokens, threads=args.threads,
                        draft_max=args.k if mode == "lookup" else 0, n_ctx=len(p) + args.tokens + 64)
                        for text, p in zip(llama_texts[kind], ids[kind])]
                    llama_rates.setdefault(kind, {}).setdefault(mode, []).append(
                        sum(r.tokens for r in runs) / sum(r.prefill_s + r.decode_s for r in runs))
                    c = llama_counts.setdefault((kind, mode), [0, 0, 0, 0])
                    for r in runs:
                        c[0] += r.tokens
                        c[1] += r.drafted
                        c[2] += r.accepted
                        c[3] += round(r.decode_s * 1e6)
                    llama_runs[(kind, mode)] = runs
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    same = all(texts[(k, b, m)] == texts[(k, b, "plain")] for k in KINDS for b in batches for m in configs)
    tokens = args.prompts * args.tokens  # per (kind, batch) run: the same requests either way
    rows = []
    for kind in KINDS:
        for batch in batches:
            runs = seconds[(kind, batch)]
            row = {"kind": kind, "batch": batch}
            for mode in configs:
                row[f"{mode}_tok_s"] = tokens / statistics.median(runs[mode])
                if mode != "plain":
                    row[f"{mode}_ratio"] = statistics.median(p / s for p, s in zip(runs["plain"], runs[mode]))
                    drafted, kept = counts[(kind, batch, mode)]
                    row[f"{mode}_acceptance"] = kept / drafted if drafted else None
                    row[f"{mode}_drafted_per_token"] = drafted / (tokens * args.rounds)
            if lookup and batch == 1:
                row.update(llama_row(kind, llama_rates[kind], llama_counts, llama_runs))
            rows.append(row)
    agreement = llama_agreement(tokenizer, ids, texts, llama_runs) if lookup else {}

    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except (StopIteration, OSError):
        pass
    modes = [m for m in configs if m != "plain"]
    header = ("| prompts | batch | plain tok/s | " + " | ".join(f"{m} tok/s (x plain) | {m} accepted" for m in modes)
              + (" | llama.cpp plain tok/s | llama.cpp lookup tok/s (x plain) | lookup accepted" if lookup else "")
              + " |\n|---|---|---|" + "---|---|" * len(modes) + ("---|---|---|" if lookup else ""))
    name = args.model or "shipped model (kvlab.load(), float32)"
    print(f"\n{name}, greedy, {args.tokens} new tokens x {args.prompts} requests, ngram k={args.k}, ngram-off: "
          f"disable_by_batch_size {args.disable_by_batch_size}, draft {draft or '-'} k={args.draft_k}, {args.rounds} "
          f"rounds, OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}, CPU: {cpu}; same text in every mode: "
          f"{same}")
    print(llama_note)
    for kind, agree in agreement.items():
        print(f"  {kind}: {agree}")
    print()
    print(header)
    for r in rows:
        cells = []
        for m in modes:
            acc = "-" if r[f"{m}_acceptance"] is None else f"{100 * r[f'{m}_acceptance']:.0f} %"
            cells.append(f"{r[f'{m}_tok_s']:.0f} ({r[f'{m}_ratio']:.2f}x) | {acc}")
        if lookup:
            if "llama_plain_tok_s" in r:
                acc = "-" if r["llama_lookup_acceptance"] is None else f"{100 * r['llama_lookup_acceptance']:.0f} %"
                cells.append(f"{r['llama_plain_tok_s']:.0f} | {r['llama_lookup_tok_s']:.0f} "
                             f"({r['llama_lookup_ratio']:.2f}x) | {acc}")
            else:
                cells.append("- | - | -")
        print(f"| {r['kind']} | {r['batch']} | {r['plain_tok_s']:.0f} | " + " | ".join(cells) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    stem = f"bench_speculative_{Path(args.model).stem}" if args.model else "bench_speculative"
    (OUT / f"{stem}.json").write_text(json.dumps(
        {"model": name, "cpu": cpu, "rounds": args.rounds, "tokens": args.tokens, "k": args.k, "draft_k": args.draft_k,
         "same_text": same, "llama_cpp": llama_note, "llama_cpp_agreement": agreement, "rows": rows}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
