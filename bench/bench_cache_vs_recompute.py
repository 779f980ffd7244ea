"""Cached generation vs recomputing the whole prefix every step, side by side in one run.

A mid-size random Llama (8 layers, hidden 512, 8 query heads, 2 KV heads, float32) generates N tokens
greedily from a 16-token prompt, once with the KV cache and once without. Both runs produce the same
tokens (checked); we record the cumulative wall time at N = 64, 128, ..., so one long run of each serves
every length. Also prints the number of K/V rows each computes per layer.

    python bench/bench_cache_vs_recompute.py [--max-new-tokens 1024] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))

    import numpy as np

    from kvlab import LlamaModel, ModelConfig, stream_generate

    config = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaModel(config, dtype=np.float32, seed=0)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, size=(1, args.prompt_tokens))
    marks = [n for n in (64, 128, 256, 512, 1024, 2048) if n <= args.max_new_tokens]
    if args.max_new_tokens not in marks:
        marks.append(args.max_new_tokens)

    def timed(use_cache: bool) -> tuple[dict[int, float], list[int]]:
        times, tokens, start = {}, [], time.perf_counter()
        for step, token in enumerate(stream_generate(model, prompt, args.max_new_tokens, use_cache=use_cache),
                                     start=1):
            tokens.append(int(token[0]))
            if step in marks:
                times[step] = time.perf_counter() - start
        return times, tokens

    params = sum(a.size for a in [model.embed, model.norm] + [w for layer in model.layers
                 for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)])
    print(f"model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads}"
          f" heads / {config.num_key_value_heads} KV heads, {params / 1e6:.1f}M params, float32; prompt "
          f"{args.prompt_tokens} tokens; OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")
    cached, cached_tokens = timed(True)
    full, full_tokens = timed(False)
    assert cached_tokens == full_tokens, "cached and recomputed generations diverged"
    print(f"{'new tokens':>10} {'cached s':>10} {'recompute s':>12} {'ratio':>8} {'K/V rows cached':>16} "
          f"{'K/V rows recompute':>19}")
    p = args.prompt_tokens
    for n in marks:
        rows_cached = p + n - 1
        rows_full = sum(p + i for i in range(n))
        print(f"{n:>10} {cached[n]:>10.2f} {full[n]:>12.2f} {full[n] / cached[n]:>7.1f}x {rows_cached:>16,} "
              f"{rows_full:>19,}")
    print("identical tokens: yes")


if __name__ == "__main__":
    main()
