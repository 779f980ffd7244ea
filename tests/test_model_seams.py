"""The model's shape: one layer loop behind two seams (Ops, Attention), and no concrete cache class inside.

Every forward (a prefill, a decode step, the engine's batched paged step) runs the
same loop, `ops.qkv_rope` -> `attention` -> `ops.output_mlp` once per layer; kvlab/model/ names the cache
only through the protocols of kvlab/cache/base.py; nothing outside kvlab/model/ reaches into the model's
private members.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import numpy as np
import pytest

from kvlab import TinyLlama
from kvlab.cache.paged import BlockPool
from kvlab.model.batch import BatchInput

ROOT = Path(__file__).resolve().parent.parent


class CountingOps:
    """Wraps a model's Ops and counts the calls the layer loop makes."""

    def __init__(self, ops) -> None:
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def qkv_rope(self, x, layer, rope):
        self.calls.append(("qkv_rope", x.shape[0]))
        return self.ops.qkv_rope(x, layer, rope)

    def output_mlp(self, x, o, layer):
        self.calls.append(("output_mlp", x.shape[0]))
        return self.ops.output_mlp(x, o, layer)

    def decode_block(self, x, layer, rope, attention):
        self.calls.append(("decode_block", x.shape[0]))
        return self.ops.decode_block(x, layer, rope, attention)


@pytest.mark.parametrize("backend,dtype", [("numba", np.float32), ("numba", np.float64), ("numpy", np.float64)])
def test_every_forward_runs_the_one_layer_loop(backend, dtype):
    model = TinyLlama(seed=1, backend=backend, dtype=dtype)
    counting = model.ops = CountingOps(model.ops)
    layers = model.config.num_hidden_layers

    def loop(rows):
        return [("qkv_rope", rows), ("output_mlp", rows)] * layers

    cache = model.new_cache(2)
    model.forward(np.arange(10).reshape(2, 5), cache=cache)                      # prefill, 2 rows x 5
    model.forward([[3], [4]], cache=cache)                                       # decode
    pool = BlockPool(layers, model.config.num_key_value_heads, model.config.head_dim, model.dtype, 4, 4)
    batch = BatchInput(np.array([1, 2, 3, 4]), np.array([0, 1, 2, 0]), [3, 1], [3, 1], [[0], [1]],
                       np.array([0, 1, 2, 4]), np.array([2, 3]))
    logits = model.forward_batch(batch, pool)                                    # the engine's paged step
    assert logits.shape == (2, model.config.vocab_size)
    # the compiled decode step of a float32 model runs each block in one call (kernels/decode_block.py): the
    # same loop, fused; float64 (the reference) and the NumPy backend make the three calls
    decode = [("decode_block", 2)] * layers if backend == "numba" and dtype == np.float32 else loop(2)
    assert counting.calls == loop(10) + decode + loop(4)


def test_model_imports_no_concrete_cache_class():
    """kvlab/model/ knows the Cache and PagedKV protocols (and CacheSpec, a value), never KVCache or BlockPool."""
    seen = []
    for path in sorted((ROOT / "kvlab" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvlab.cache") for a in node.names), f"{path.name}: import module"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlab.cache"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(module, alias.name)
                    seen.append(alias.name)
                    if isinstance(value, type):
                        allowed = getattr(value, "_is_protocol", False) or dataclasses.is_dataclass(value)
                        assert allowed, f"{path.name} imports the concrete class {alias.name} from {node.module}"
    assert {"Cache", "PagedKV"} <= set(seen)  # the check looked at the imports that matter


def test_nothing_outside_the_model_touches_its_private_members():
    pattern = re.compile(r"\bmodel\._[A-Za-z]")
    offenders = []
    for folder in ("kvlab", "bench", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_relative_to(ROOT / "kvlab" / "model") or path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
