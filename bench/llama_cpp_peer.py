"""llama.cpp as a peer in the benchmarks: the same weights as GGUF files, driven from a worker process.

`write_gguf` stores an HF Llama checkpoint as llama.cpp's converter would (GGUF names, Q/K rows permuted
into ggml's RoPE pair order, norms in F32, matrices in F32 or F16) with a placeholder SentencePiece
vocabulary of the right size: the benchmarks feed token ids, so no text is ever tokenized.
`LlamaCppWorker` runs llama-cpp-python in a child process (its OpenMP runtime apart from numba's) and
answers one request per line: prefill a prompt of `context` random ids, then decode `steps` tokens;
it returns the prefill seconds and the median decode seconds per token.

`llama-bench` (llama.cpp's own benchmark binary) is driven by `run_llama_bench` and its JSON read by
`parse_llama_bench`; `decode_weight_bytes` and `kv_bytes` say what a llama.cpp decode step reads of a GGUF
file and of its cache (the roofline's numerator), from the file's tensor directory.

    python bench/llama_cpp_peer.py worker MODEL.gguf THREADS N_CTX [logits_all]   (what LlamaCppWorker starts)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

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


def worker_available(env: Mapping[str, str]) -> str:
    """'' when llama-cpp-python imports in a child process with `env` (LLAMA_CPP_LIB_PATH naming a
    libllama.so built apart), else why not. A child, so this process never loads llama.cpp's OpenMP."""
    out = subprocess.run([sys.executable, "-c", "import llama_cpp"], env=dict(env), capture_output=True, text=True)
    if out.returncode == 0:
        return ""
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return f"llama-cpp-python not importable ({last})"


def find_llama_bench(given: str | None) -> Path | None:
    """The llama-bench binary: `given` (a path), else $LLAMA_BENCH, else `llama-bench` on PATH."""
    found = given or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    return Path(found) if found and Path(found).is_file() else None


# --- what a llama.cpp decode step reads ----------------------------------------------------------------
def tensor_bytes(type_name: str, n_elements: int) -> int:
    """Bytes of `n_elements` values of ggml type `type_name` ("Q4_K", "F16", "q8_0" ...), from ggml's own
    (weights per block, bytes per block) table in the `gguf` package."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]]
    if n_elements % block:
        raise ValueError(f"{n_elements} values are not whole {type_name} blocks of {block}")
    return n_elements // block * size


def decode_weight_bytes(tensors: Iterable[tuple[str, str, Sequence[int]]]) -> int:
    """Weight bytes one llama.cpp decode step reads: every matrix of (name, ggml type, shape) once, as
    stored. The token embedding is a row gather (one row a token) unless the file has no output.weight,
    when it doubles as the LM head and is read whole. Norm vectors (~0.1 MB here) are left out."""
    listed = [(name, kind, tuple(shape)) for name, kind, shape in tensors]
    tied = not any(name == "output.weight" for name, _, _ in listed)
    total = 0
    for name, kind, shape in listed:
        if len(shape) != 2 or (name == "token_embd.weight" and not tied):
            continue
        total += tensor_bytes(kind, shape[0] * shape[1])
    return total


def kv_bytes(layers: int, kv_heads: int, head_dim: int, context: int, type_k: str = "f16",
             type_v: str = "f16") -> int:
    """Bytes of K and V a decode step reads at `context` cached positions (llama.cpp's cache types,
    "f16" by default; "q8_0" etc. as blocks)."""
    per_type = layers * kv_heads * head_dim * context
    return tensor_bytes(type_k, per_type) + tensor_bytes(type_v, per_type)


def gguf_tensors(path: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, ggml type, shape) of every tensor in a GGUF file's directory (no payload is read)."""
    from kvlab.gguf.reader import read_gguf

    return [(info.name, info.type_name, info.shape) for info in read_gguf(path).tensors.values()]


def compare_tensors(a: Path, b: Path) -> dict[str, list[str]]:
    """Tensors of two GGUF files by name: "identical" bytes, "differ" (same type and shape, other bytes),
    "other_type" (stored in different types or shapes) and "unpaired" (in one file only). kvlab's encoders
    are llama.cpp's reference encoders, so a kvlab file and llama-quantize's of the same type and source
    should share every tensor they store alike."""
    from kvlab.gguf.reader import read_gguf

    fa, fb = read_gguf(a), read_gguf(b)
    result: dict[str, list[str]] = {"identical": [], "differ": [], "other_type": [], "unpaired": []}
    for name in sorted(set(fa.tensors) | set(fb.tensors)):
        ia, ib = fa.tensors.get(name), fb.tensors.get(name)
        if ia is None or ib is None:
            result["unpaired"].append(name)
        elif (ia.type_name, ia.shape) != (ib.type_name, ib.shape):
            result["other_type"].append(name)
        else:
            result["identical" if np.array_equal(fa.raw(name), fb.raw(name)) else "differ"].append(name)
    return result


# --- llama-bench -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchRecord:
    """One llama-bench test: "pp" (a prompt of `tokens`) or "tg" (`tokens` generated one by one) after
    `depth` cached tokens; tokens/s of the best and of the mean repetition."""

    test: str
    tokens: int
    depth: int
    best_tokens_per_s: float
    mean_tokens_per_s: float
    threads: int
    type_k: str
    type_v: str
    flash_attn: str


def parse_llama_bench(text: str) -> list[BenchRecord]:
    """llama-bench's `-o json` output (a JSON array, one object per test) as BenchRecords. A test with both
    a prompt and generation (-pg) is refused: its tokens/s mixes two things."""
    records = []
    for item in json.loads(text):
        prompt, gen = int(item["n_prompt"]), int(item["n_gen"])
        if (prompt > 0) == (gen > 0):
            raise ValueError(f"llama-bench test with n_prompt={prompt}, n_gen={gen}: expected a pp or a tg test")
        samples = [float(v) for v in item.get("samples_ts") or [item["avg_ts"]]]
        records.append(BenchRecord(test="pp" if prompt else "tg", tokens=prompt or gen,
                                   depth=int(item.get("n_depth", 0)), best_tokens_per_s=max(samples),
                                   mean_tokens_per_s=float(item["avg_ts"]), threads=int(item["n_threads"]),
                                   type_k=str(item.get("type_k", "f16")), type_v=str(item.get("type_v", "f16")),
                                   flash_attn=str(item.get("flash_attn", ""))))
    return records


def run_llama_bench(binary: Path, model: Path, threads: int, env: Mapping[str, str], *,
                    prompts: Sequence[int] = (), gen: int = 0, depths: Sequence[int] = (0,),
                    repetitions: int = 3) -> list[BenchRecord]:
    """Run llama-bench once: pp tests of `prompts` tokens and/or a tg test of `gen` tokens, at each depth."""
    command = [str(binary), "-m", str(model), "-t", str(threads), "-r", str(repetitions), "-o", "json",
               "-p", ",".join(map(str, prompts)) or "0", "-n", str(gen), "-d", ",".join(map(str, depths))]
    out = subprocess.run(command, env=dict(env), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return parse_llama_bench(out.stdout)


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

    def __init__(self, model: Path, threads: int, n_ctx: int, env: Mapping[str, str],
                 logits_all: bool = False) -> None:
        """`logits_all`: keep the logits of every position (for `all_logits`; costs n_ctx x vocab floats)."""
        command = [sys.executable, __file__, "worker", str(model), str(threads), str(n_ctx)]
        self.proc = subprocess.Popen(command + (["logits_all"] if logits_all else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(env))
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

    def all_logits(self, ids: list[int]) -> np.ndarray:
        """llama.cpp's logits [len(ids), vocab] at every position of a fresh prompt of `ids` (the worker
        must have been started with `logits_all`); passed through a .npy file, read without pickle."""
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "logits.npy"
            self.proc.stdin.write(f"scores {path} " + " ".join(map(str, ids)) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().strip()
            if answer != "saved":
                raise RuntimeError(f"llama.cpp worker did not return logits: {answer!r}")
            return np.load(path, allow_pickle=False)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _worker(model: str, threads: int, n_ctx: int, logits_all: bool) -> None:
    from llama_cpp import Llama

    llm = Llama(model, n_ctx=n_ctx, n_batch=min(n_ctx, 4096), n_threads=threads, n_threads_batch=threads,
                logits_all=logits_all, verbose=False)
    print("ready", flush=True)
    rng = np.random.default_rng(0)
    for line in sys.stdin:
        if line.startswith("scores "):
            _, path, *ids = line.split()
            llm.reset()
            llm.eval([int(t) for t in ids])
            np.save(path, np.array(llm.scores[:len(ids)], dtype=np.float32))
            print("saved", flush=True)
            continue
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
    if len(sys.argv) in (5, 6) and sys.argv[1] == "worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["logits_all"])
    else:
        sys.exit(__doc__)
