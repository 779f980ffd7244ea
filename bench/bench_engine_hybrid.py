"""What a long request holds on a Gemma-3-shaped hybrid model: KV-cache groups vs every layer keeping every token.

(Also the contiguous KVCache, as `kvlab.generate` builds it: sliding layers trimmed vs every row kept.)

A random model with Gemma 3's layer pattern (5 sliding layers per full one; `--layers`, `--window`, 1 KV head,
head_dim 32 so a run takes seconds) runs one request of `--tokens` tokens (a prompt plus `--new` greedy
tokens) through the engine. Measured, at the request's longest point: the blocks each KV-cache group held
and their bytes, against what the engine held before KV-cache groups (every layer's block for every token:
blocks_for(T) x all layers); the bound `window_max_blocks` the sliding group stays within; and whether the
greedy tokens equal a second engine run with a larger chunk budget (batched == alone is tested in
tests/test_engine_hybrid.py). Counts and bytes, not times: nothing here depends on the machine.

    python bench/bench_engine_hybrid.py [--tokens 2048] [--window 64] [--block-size 16] [--chunk 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlab import Engine, SamplingParams  # noqa: E402
from kvlab.cache.kv_cache import new_cache  # noqa: E402
from kvlab.cache.memory import kv_bytes_per_block  # noqa: E402
from kvlab.config import ModelConfig  # noqa: E402
from kvlab.engine.kv_bounds import window_max_blocks  # noqa: E402
from kvlab.model.llama import LlamaModel  # noqa: E402


def gemma3_shaped(layers: int, window: int, context: int) -> LlamaModel:
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=context, layer_types=types, interleaved_sliding_window=window,
                         hidden_act="gelu_pytorch_tanh", norm_weight_offset=1.0, sandwich_norm=True,
                         scale_embeddings=True, qk_norm=True, bos_token_id=None, eos_token_id=None)
    return LlamaModel(config, dtype="float32", seed=1)


def run(model: LlamaModel, prompt: list[int], new: int, block_size: int, chunk: int):
    engine = Engine(model, block_size=block_size, max_num_seqs=1, max_num_batched_tokens=chunk,
                    enable_prefix_caching=False)
    engine.add_request("long", prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    most = [0] * len(engine.kv_groups)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            most = [max(m, len(g.held(seq))) for m, g in zip(most, engine.kv_groups)]
    return engine, most, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=128)
    args = parser.parse_args()
    model = gemma3_shaped(args.layers, args.window, args.tokens + 1)
    prompt = [(7 * t + 3) % 256 for t in range(args.tokens - args.new)]
    engine, most, tokens = run(model, prompt, args.new, args.block_size, args.chunk)
    _, _, again = run(model, prompt, args.new, args.block_size, 2 * args.chunk)
    held = sum(m * g.pool.bytes_per_block for m, g in zip(most, engine.kv_groups))
    before_blocks = -(-(args.tokens - 1) // args.block_size)  # the last token's K/V is never computed
    before = before_blocks * kv_bytes_per_block(model.config, args.block_size, model.dtype)
    print(f"Gemma-3-shaped: {args.layers} layers ({sum(len(g.layers) for g in engine.kv_groups[1:])} sliding, "
          f"window {args.window}), {args.tokens} tokens, block {args.block_size}, chunk {args.chunk}, float32")
    print("| group | layers | blocks held (most) | bound | bytes held |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for m, g in zip(most, engine.kv_groups):
        bound = window_max_blocks(args.tokens, args.block_size, g.window, args.chunk)
        name = "full" if g.window is None else f"sliding ({g.window})"
        print(f"| {name} | {len(g.layers)} | {m} | {bound} | {m * g.pool.bytes_per_block:,} |")
    print(f"| before (every layer, every token) | {args.layers} | {before_blocks} | | {before:,} |")
    print(f"held / before: {held / before:.3f} (full-attention share alone: "
          f"{len(engine.kv_groups[0].layers) / args.layers:.3f}); greedy tokens equal across chunk budgets: "
          f"{tokens == again}")
    # the contiguous KVCache (kvlab.generate's): prefill in --chunk pieces, then the decode steps
    caches = {"every row": new_cache(model.cache_spec),
              "sliding layers trimmed": new_cache(model.cache_spec, windows=[
                  model.config.layer_window(i) for i in range(args.layers)])}
    greedy = {}
    for name, cache in caches.items():
        for start in range(0, len(prompt), args.chunk):
            logits = model.forward([prompt[start:start + args.chunk]], cache=cache, logits_to_keep=1).logits
        out = []
        for _ in range(args.new - 1):
            out.append(int(logits[0, -1].argmax()))
            logits = model.forward([[out[-1]]], cache=cache).logits
        greedy[name] = out
    plain, trimmed = (c.memory_report() for c in caches.values())
    print(f"contiguous KVCache at {trimmed.num_tokens} tokens: payload {trimmed.payload_bytes:,} of "
          f"{plain.payload_bytes:,} ({trimmed.payload_bytes / plain.payload_bytes:.3f}), capacity "
          f"{trimmed.capacity_bytes:,} of {plain.capacity_bytes:,} "
          f"({trimmed.capacity_bytes / plain.capacity_bytes:.3f}); greedy tokens equal: "
          f"{len(set(map(tuple, greedy.values()))) == 1}")


if __name__ == "__main__":
    main()
