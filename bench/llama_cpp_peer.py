"""llama.cpp as a peer in the benchmarks: the same weights as GGUF files, driven from a worker process.

`write_gguf` stores an HF Llama checkpoint as llama.cpp's converter would (GGUF names, Q/K rows permuted
into ggml's RoPE pair order, norms in F32, matrices in F32 or F16) with a placeholder SentencePiece
vocabulary of the right size: the benchmarks feed token ids, so no text is ever tokenized.
`LlamaCppWorker` runs llama-cpp-python in a child process (its OpenMP runtime apart from numba's) and
answers one request per line: prefill a prompt of `context` random ids, then decode `steps` tokens;
it returns the prefill seconds and the median decode seconds per token.

    python bench/llama_cpp_peer.py worker MODEL.gguf THREADS N_CTX    (what LlamaCppWorker starts)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LAYER_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def available() -> str:
    """'' when llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # not installed, or a build that fails to load
        return f"llama-cpp-python not importable ({type(exc).__name__}: {exc})"
    return ""


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half Q/K rows -> ggml's interleaved pairs (llama.cpp's convert_hf_to_gguf permute)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(hf_dir: Path, path: Path, qtype: str) -> None:
    """An HF Llama folder (config.json + model.safetensors, float32 or bfloat16) as a GGUF file with its
    matrices in `qtype` ("F32" or "F16"). Skipped when `path` exists."""
    if path.is_file():
        return
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope_theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    weights = load_file(str(hf_dir / "model.safetensors"))
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name(hf_dir.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type({"F32": 0, "F16": 1}[qtype])
    vocab = cfg["vocab_size"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array in weights.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"
        else:
            gguf_name = TOP_LEVEL[name]
        array = np.asarray(array, dtype=np.float32)
        if ".q_proj." in name:
            array = _permute(array, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            array = _permute(array, cfg["num_key_value_heads"])
        if array.ndim == 2 and qtype == "F16":
            array = array.astype(np.float16)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)


class LlamaCppWorker:
    """One llama.cpp model in a child process; `run(context, steps)` -> (prefill s, median decode s/token)."""

    def __init__(self, model: Path, threads: int, n_ctx: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "worker", str(model), str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"llama.cpp worker for {model} did not start: {ready!r}")

    def run(self, context: int, steps: int) -> tuple[float, float]:
        self.proc.stdin.write(f"{context} {steps}\n")
        self.proc.stdin.flush()
        prefill, decode = map(float, self.proc.stdout.readline().split())
        return prefill, decode

    def last_logits(self, ids: list[int]) -> np.ndarray:
        """llama.cpp's logits after a fresh prompt of `ids` (its last position): checks the GGUF holds the
        same model, so the timings compare like with like."""
        self.proc.stdin.write("logits " + " ".join(map(str, ids)) + "\n")
        self.proc.stdin.flush()
        return np.array(self.proc.stdout.readline().split(), dtype=np.float32)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _worker(model: str, threads: int, n_ctx: int) -> None:
    from llama_cpp import Llama

    llm = Llama(model, n_ctx=n_ctx, n_batch=min(n_ctx, 4096), n_threads=threads, n_threads_batch=threads,
                verbose=False)
    print("ready", flush=True)
    rng = np.random.default_rng(0)
    for line in sys.stdin:
        if line.startswith("logits "):
            llm.reset()
            llm.eval([int(t) for t in line.split()[1:]])
            # without logits_all, llama-cpp-python 0.3 keeps no scores: read the context's one output row
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            print(" ".join(f"{v:.9g}" for v in logits), flush=True)
            continue
        context, steps = map(int, line.split())
        prompt = [int(t) for t in rng.integers(300, llm.n_vocab(), size=context)]
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        times = []
        for i in range(steps):  # the token fed does not change the work; argmax would add a vocab scan
            start = time.perf_counter()
            llm.eval([300 + i])
            times.append(time.perf_counter() - start)
        print(prefill, statistics.median(times), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)
