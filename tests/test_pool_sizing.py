"""The bytes kvlab sizes are the bytes it allocates (issue 18 items 5 and 6).

Item 5: a quantized pool sized by memory (`kv_cache_memory="8MiB"` with int8/int4) divided the budget by a
float and was refused ("num_blocks must be a positive int, got 910.0"); and it counted int8/int4 scales per
32 values even where head_dim is not a multiple of 32 (the store keeps one group per head then). Item 6:
`kvlab memory --model M` headlined the checkpoint's float16 while generate, chat and serve allocate float32.
"""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import kvlab
from kvlab import Engine, TinyLlama
from kvlab.cache.memory import kv_bytes_per_block
from kvlab.cache.paged import BlockPool
from kvlab.validate import parse_size

MODELS = {"head_dim 8": dict(), "head_dim 32": dict(dtype=np.float32, head_dim=32)}
DTYPES = ["int8", "int4", "fp8_e4m3", "float16", "bfloat16", None]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(MODELS), ids=str)
def test_a_memory_budget_buys_whole_blocks_within_it(shape, dtype):
    model = TinyLlama(**MODELS[shape])
    engine = Engine(model, kv_cache_dtype=dtype, kv_cache_memory="8MiB")
    pool = engine.block_pool
    budget = parse_size("8MiB")
    assert type(pool.num_blocks) is int
    assert pool.capacity_bytes <= budget < pool.capacity_bytes + pool.bytes_per_block  # as many as fit
    out = engine.generate([list(range(1, 20))], kvlab.SamplingParams(max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(MODELS), ids=str)
def test_memory_formula_equals_what_the_pool_allocates(shape, dtype):
    model = TinyLlama(**MODELS[shape])
    c = model.config
    kv_dtype = kvlab.cache.dtypes.resolve_kv_dtype(dtype, model.dtype)
    pool = BlockPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype, 16, 3,
                     compute_dtype=model.dtype)
    assert pool.bytes_per_block == kv_bytes_per_block(c, 16, kv_dtype)


def _memory_json(path) -> dict:
    done = subprocess.run([sys.executable, "-m", "kvlab", "memory", "--model", str(path), "--json", "--tokens", "8"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _allocated_bytes_per_token(model) -> float:
    cache = model.forward(np.arange(8)[None], use_cache=True).cache
    report = cache.memory_report()
    return report.payload_bytes / report.num_tokens


def test_memory_headlines_what_kvlab_allocates_for_an_hf_folder(tmp_path):
    from test_hf_loader import write_folder

    folder = tmp_path / "m"
    write_folder(folder, dtype=ml_dtypes.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    out = _memory_json(folder)
    model, _ = kvlab.load(folder)  # as generate, chat and serve load it
    assert out["dtype"] == model.new_cache(1).dtype.name == "float32"
    assert out["bytes_per_token"] == _allocated_bytes_per_token(model)
    engine = Engine(model)
    assert out["bytes_per_token"] == engine.block_pool.bytes_per_block / engine.block_pool.block_size


def test_memory_headlines_what_kvlab_allocates_for_a_gguf_file(tmp_path):
    from gguf_files import small_config, write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, small_config(), types=("F16",))
    out = _memory_json(path)
    model, _ = kvlab.load(path)
    assert out["dtype"] == "float32"
    assert out["bytes_per_token"] == _allocated_bytes_per_token(model)
