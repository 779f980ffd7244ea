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

    python bench/bench_speculative.py [--rounds 5] [--tokens 96] [--k 5] [--threads 1] [--quick]
    python bench/bench_speculative.py --model SmolLM2-135M-Instruct.Q4_1.gguf   # an instruct model, chat prompts

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
    function renamed, summarise quoting the passage, write freely."""
    passages = [f"{a}.\n{b}." for a, b in zip(LINES, LINES[1:] + LINES[:1])]
    if kind == "copy":
        return [f"Repeat the following text exactly, word for word:\n\n{p}" for p in passages]
    if kind == "code edit":
        return [f"Rewrite this Python function with its name changed to {name}_again, everything else the same:"
                f"\n\ndef {name}(lord, lady):\n    line = \"{line[:40]}\"\n    if lord:\n        return line\n"
                f"    return lady + line\n" for name, line in zip(NAMES, LINES)]
    if kind == "quote summary":
        return [f"Summarize this passage in one sentence, then quote it in full:\n\n{p}" for p in passages]
    return [f"Write a short story that begins: {opening}" for opening in OPENINGS]


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
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.tokens = 2, 48
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))

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
    context = model.config.max_position_embeddings
    for kind, group in ids.items():
        assert max(len(p) for p in group) + args.tokens <= context, (kind, max(len(p) for p in group))
    for engine in engines.values():  # warm-up: compile or load every kernel a run will call
        engine.generate(ids["copy"][:2], params)

    # (kind, batch) -> mode -> per-round seconds and tokens; acceptance counters per mode
    seconds: dict[tuple[str, int], dict[str, list[float]]] = {}
    counts: dict[tuple[str, int, str], list[int]] = {}
    texts: dict[tuple[str, int, str], list[list[int]]] = {}
    for rnd in range(args.rounds):
        for kind in KINDS:
            for batch in (1, 8):
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
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    same = all(texts[(k, b, m)] == texts[(k, b, "plain")] for k in KINDS for b in (1, 8) for m in configs)
    tokens = 8 * args.tokens  # per (kind, batch) run: 8 requests either way
    rows = []
    for kind in KINDS:
        for batch in (1, 8):
            runs = seconds[(kind, batch)]
            row = {"kind": kind, "batch": batch}
            for mode in configs:
                row[f"{mode}_tok_s"] = tokens / statistics.median(runs[mode])
                if mode != "plain":
                    row[f"{mode}_ratio"] = statistics.median(p / s for p, s in zip(runs["plain"], runs[mode]))
                    drafted, kept = counts[(kind, batch, mode)]
                    row[f"{mode}_acceptance"] = kept / drafted if drafted else None
                    row[f"{mode}_drafted_per_token"] = drafted / (tokens * args.rounds)
            rows.append(row)

    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except (StopIteration, OSError):
        pass
    modes = [m for m in configs if m != "plain"]
    header = ("| prompts | batch | plain tok/s | " + " | ".join(f"{m} tok/s (x plain) | {m} accepted" for m in modes)
              + " |\n|---|---|---|" + "---|---|" * len(modes))
    name = args.model or "shipped model (kvlab.load(), float32)"
    print(f"\n{name}, greedy, {args.tokens} new tokens x 8 requests, ngram k={args.k}, ngram-off: "
          f"disable_by_batch_size {args.disable_by_batch_size}, draft {draft or '-'} k={args.draft_k}, {args.rounds} "
          f"rounds, OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}, CPU: {cpu}; same text in every mode: "
          f"{same}\n")
    print(header)
    for r in rows:
        cells = []
        for m in modes:
            acc = "-" if r[f"{m}_acceptance"] is None else f"{100 * r[f'{m}_acceptance']:.0f} %"
            cells.append(f"{r[f'{m}_tok_s']:.0f} ({r[f'{m}_ratio']:.2f}x) | {acc}")
        print(f"| {r['kind']} | {r['batch']} | {r['plain_tok_s']:.0f} | " + " | ".join(cells) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    stem = f"bench_speculative_{Path(args.model).stem}" if args.model else "bench_speculative"
    (OUT / f"{stem}.json").write_text(json.dumps(
        {"model": name, "cpu": cpu, "rounds": args.rounds, "tokens": args.tokens, "k": args.k, "draft_k": args.draft_k,
         "same_text": same, "rows": rows}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
