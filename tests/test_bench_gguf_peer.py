"""The pure helpers of bench/bench_gguf_peer.py and bench/llama_cpp_peer.py: what each engine's decode step
reads (the roofline's numerator) per GGUF type, and reading llama-bench's JSON. Nothing here needs llama.cpp:
its output is a recorded sample, and the GGUF files are written by the `gguf` package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
gguf = pytest.importorskip("gguf")

import bench_gguf_peer  # noqa: E402
import llama_cpp_peer  # noqa: E402
from kvlab_timing import step_bytes  # noqa: E402
from kvlab import LlamaModel  # noqa: E402
from kvlab.config import ModelConfig  # noqa: E402
from kvlab.model.quantized import quantize_weights  # noqa: E402
from kvlab.model.weights import random_weights  # noqa: E402

# ggml's block layouts, written out from ggml-common.h (block_q8_0 = f16 d + 32 int8 ...), not read from
# the table the helper uses: (weights per block, bytes per block).
GGML_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 2 + 32), "Q4_0": (32, 2 + 16),
               "Q4_1": (32, 2 + 2 + 16), "Q5_0": (32, 2 + 4 + 16), "Q5_1": (32, 2 + 2 + 4 + 16),
               "Q4_K": (256, 2 + 2 + 12 + 128), "Q5_K": (256, 2 + 2 + 12 + 32 + 128),
               "Q6_K": (256, 128 + 64 + 16 + 2), "Q2_K": (256, 16 + 64 + 2 + 2), "Q3_K": (256, 32 + 64 + 12 + 2)}


@pytest.mark.parametrize("type_name", sorted(GGML_BLOCKS))
def test_tensor_bytes_follow_ggml_block_layouts(type_name):
    block, size = GGML_BLOCKS[type_name]
    assert llama_cpp_peer.tensor_bytes(type_name, 3 * 256) == 3 * 256 // block * size
    assert llama_cpp_peer.tensor_bytes(type_name.lower(), 576 * 1536) == 576 * 1536 // block * size
    if block > 1:
        with pytest.raises(ValueError, match="whole"):
            llama_cpp_peer.tensor_bytes(type_name, block + 1)


def smollm_like_directory(embed_type: str, matrix_type: str, tied: bool) -> list[tuple[str, str, tuple]]:
    """A tensor directory of SmolLM2-135M's shape (2 layers of 30), as a GGUF file lists it."""
    tensors = [("token_embd.weight", embed_type, (49152, 576)), ("output_norm.weight", "F32", (576,))]
    if not tied:
        tensors.append(("output.weight", "Q5_1", (49152, 576)))
    for i in range(2):
        tensors += [(f"blk.{i}.attn_norm.weight", "F32", (576,)), (f"blk.{i}.attn_q.weight", matrix_type, (576, 576)),
                    (f"blk.{i}.attn_k.weight", matrix_type, (192, 576)), (f"blk.{i}.attn_v.weight", "Q8_0", (192, 576)),
                    (f"blk.{i}.attn_output.weight", matrix_type, (576, 576)),
                    (f"blk.{i}.ffn_gate.weight", matrix_type, (1536, 576)),
                    (f"blk.{i}.ffn_up.weight", matrix_type, (1536, 576)),
                    (f"blk.{i}.ffn_down.weight", "Q6_K", (576, 1536)), (f"blk.{i}.ffn_norm.weight", "F32", (576,))]
    return tensors


def bytes_of(type_name: str, count: int) -> int:
    block, size = GGML_BLOCKS[type_name]
    return count // block * size


@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "F16"])
@pytest.mark.parametrize("tied", [True, False])
def test_decode_weight_bytes_count_every_matrix_once_and_the_embedding_only_as_the_lm_head(matrix_type, tied):
    per_layer = (bytes_of(matrix_type, 576 * 576) * 2 + bytes_of(matrix_type, 192 * 576)
                 + bytes_of("Q8_0", 192 * 576) + bytes_of(matrix_type, 1536 * 576) * 2 + bytes_of("Q6_K", 576 * 1536))
    head = bytes_of("Q8_0", 49152 * 576) if tied else bytes_of("Q5_1", 49152 * 576)
    got = llama_cpp_peer.decode_weight_bytes(smollm_like_directory("Q8_0", matrix_type, tied))
    assert got == 2 * per_layer + head


def test_decode_weight_bytes_of_a_written_file(tmp_path):
    """The directory as the `gguf` package writes it and kvlab's reader lists it (numpy-order shapes)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    sizes = {"token_embd.weight": ((512, 64), "Q8_0"), "output.weight": ((512, 64), "Q4_1"),
             "blk.0.attn_q.weight": ((64, 64), "Q4_0"), "blk.0.ffn_down.weight": ((64, 256), "Q4_K")}
    for name, (shape, kind) in sizes.items():
        if kind == "Q4_K":  # the gguf package cannot encode K types: any bytes of the right size
            raw = rng.integers(0, 256, size=(shape[0], shape[1] // 256 * 144), dtype=np.uint8)
        else:
            raw = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), gguf.GGMLQuantizationType[kind])
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    listed = llama_cpp_peer.gguf_tensors(path)
    assert {name: (kind, tuple(shape)) for name, kind, shape in listed if len(shape) == 2} == \
        {name: (kind, shape) for name, (shape, kind) in sizes.items()}
    want = bytes_of("Q4_1", 512 * 64) + bytes_of("Q4_0", 64 * 64) + bytes_of("Q4_K", 64 * 256)  # no embedding
    assert llama_cpp_peer.decode_weight_bytes(listed) == want


def test_kv_bytes_per_cache_type():
    assert llama_cpp_peer.kv_bytes(30, 3, 64, 4096) == 2 * 30 * 3 * 64 * 4096 * 2
    assert llama_cpp_peer.kv_bytes(30, 3, 64, 4096, "q8_0", "f32") == 30 * 3 * 64 * 4096 * (34 / 32 + 4)


LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
    "model_filename": "smollm2-Q4_0.gguf", "model_type": "llama ?B Q4_0", "model_size": 90177536,
    "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0",
    "cpu_strict": false, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "split_mode": "layer",
    "main_gpu": 0, "no_kv_offload": false, "flash_attn": -1, "tensor_split": "0.00", "use_mmap": true,
    "embeddings": false, "n_prompt": 0, "n_gen": 32, "n_depth": 1024, "test_time": "2026-12-01T13:00:00Z",
    "avg_ns": 250000000, "stddev_ns": 20000000, "avg_ts": 128.5, "stddev_ts": 9.1,
    "samples_ns": [ 260000000, 230000000, 260000000 ], "samples_ts": [ 123.07, 139.13, 123.07 ]
  },
  {
    "n_threads": 2, "type_k": "q8_0", "type_v": "f16", "flash_attn": 1, "n_prompt": 128, "n_gen": 0,
    "n_depth": 0, "avg_ns": 200000000, "stddev_ns": 0, "avg_ts": 640.0, "stddev_ts": 0.0,
    "samples_ns": [ 200000000 ], "samples_ts": [ 640.0 ]
  }
]"""


def test_parse_llama_bench_reads_pp_and_tg_tests():
    tg, pp = llama_cpp_peer.parse_llama_bench(LLAMA_BENCH_JSON)
    assert (tg.test, tg.tokens, tg.depth, tg.threads) == ("tg", 32, 1024, 2)
    assert tg.best_tokens_per_s == pytest.approx(139.13) and tg.mean_tokens_per_s == pytest.approx(128.5)
    assert (tg.type_k, tg.type_v) == ("f16", "f16")
    assert (pp.test, pp.tokens, pp.depth, pp.best_tokens_per_s, pp.type_k) == ("pp", 128, 0, 640.0, "q8_0")


def test_parse_llama_bench_refuses_mixed_tests_and_falls_back_to_the_mean():
    mixed = [dict(json.loads(LLAMA_BENCH_JSON)[1], n_gen=16)]
    with pytest.raises(ValueError, match="n_prompt=128, n_gen=16"):
        llama_cpp_peer.parse_llama_bench(json.dumps(mixed))
    bare = [{k: v for k, v in json.loads(LLAMA_BENCH_JSON)[0].items() if k != "samples_ts"}]
    (only,) = llama_cpp_peer.parse_llama_bench(json.dumps(bare))
    assert only.best_tokens_per_s == pytest.approx(128.5)


CONFIG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
# q, k, v, o, gate, up, down per layer + the tied embedding as LM head, counted by hand
MATRIX_WEIGHTS = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 128 * 64 + 64 * 128) + 96 * 64
KV_FLOAT32 = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32: per cached position


@pytest.mark.parametrize("weights_dtype, width", [(None, 4), ("bfloat16", 2)])
def test_kvlab_step_bytes_of_float_and_half_weights(weights_dtype, width):
    model = LlamaModel(CONFIG, random_weights(CONFIG, 0, np.float32), dtype=np.float32, weights_dtype=weights_dtype)
    assert step_bytes(model, 100) == MATRIX_WEIGHTS * width + 100 * KV_FLOAT32
    assert step_bytes(model, 100, batch=3) == MATRIX_WEIGHTS * width + 3 * 100 * KV_FLOAT32


def test_kvlab_step_bytes_of_quantized_weights_count_what_the_model_keeps():
    weights = quantize_weights(random_weights(CONFIG, 0, np.float32), "q4_1")
    kept = sum(w.nbytes for name, w in weights.items() if np.ndim(w) == 2)  # the LM head is the embedding
    model = LlamaModel(CONFIG, weights, dtype=np.float32)
    assert step_bytes(model, 7) == kept + 7 * KV_FLOAT32
    assert kept < MATRIX_WEIGHTS  # under a byte per weight, so the quantized matrices were the ones counted


def test_files_by_type_picks_one_file_per_type_and_says_what_is_missing(tmp_path):
    for name in ("smol-F16.gguf", "smol.Q4_K_M.gguf", "smol-Q4_K_S.gguf", "a-Q8_0.gguf", "b-Q8_0.gguf",
                 "smolQ4_0.gguf"):
        (tmp_path / name).write_bytes(b"")
    files, missing = bench_gguf_peer.files_by_type([f"Q4_1={tmp_path / 'nowhere.gguf'}"], str(tmp_path),
                                                   ["F16", "Q4_K_M", "Q8_0", "Q4_0", "Q4_1"])
    assert files == {"F16": tmp_path / "smol-F16.gguf", "Q4_K_M": tmp_path / "smol.Q4_K_M.gguf"}
    assert [line.split(":")[0] for line in missing] == ["Q8_0", "Q4_0", "Q4_1"]
    assert "2 files" in missing[0] and "0 files" in missing[1] and "does not exist" in missing[2]


def test_logits_agreement_measures_the_difference_and_the_argmax():
    want = np.array([[0.0, 3.0, 1.0], [2.0, -4.0, 0.0]], dtype=np.float32)
    got = want + np.array([[0.0, -2.5, 0.0], [0.1, 0.0, 0.0]], dtype=np.float32)
    r = bench_gguf_peer.logits_agreement(got, want)
    assert r["max_abs"] == pytest.approx(2.5) and r["max_logit"] == 4.0
    assert r["relative"] == pytest.approx(2.5 / 5.0) and r["top1"] == 0.5


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_compare_tensors_sorts_each_tensor_by_how_the_two_files_store_it(tmp_path):
    rng = np.random.default_rng(1)
    w = {name: rng.standard_normal((8, 64)).astype(np.float32) for name in "abcde"}
    changed = w["b"].copy()
    changed[3, 5] += 1.0  # one weight moved: its block's codes change
    write_gguf(tmp_path / "x.gguf", {"a": (w["a"], "Q8_0"), "b": (w["b"], "Q8_0"), "c": (w["c"], "Q4_0"),
                                     "d": (w["d"], "Q8_0")})
    write_gguf(tmp_path / "y.gguf", {"a": (w["a"], "Q8_0"), "b": (changed, "Q8_0"), "c": (w["c"], "Q8_0"),
                                     "e": (w["e"], "Q8_0")})
    assert llama_cpp_peer.compare_tensors(tmp_path / "x.gguf", tmp_path / "y.gguf") == {
        "identical": ["a"], "differ": ["b"], "other_type": ["c"], "unpaired": ["d", "e"]}
