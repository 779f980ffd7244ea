"""Layers only look down: every import in kvlab/ (lazy ones inside functions too) goes to its own layer or a
lower one, read from the source with `ast` (DESIGN: "the shape we are moving to").

errors/validate -> kernels -> config/tokenizer/sampling -> cache -> model -> formats (hf, gguf) and
policies -> loader/generation -> prefix cache -> shared tier and events -> engine -> sessions ->
verify/fidelity/perplexity -> serve -> cli and the public API (kvlab/__init__.py). docs/ARCHITECTURE.md's layer
table lists the same layers in the same order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent / "kvlab"
ARCHITECTURE = ROOT.parent / "docs" / "ARCHITECTURE.md"

# (layer, module prefixes), bottom first. A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors/validate", ("kvlab.errors", "kvlab.validate")),
    ("kernels", ("kvlab.kernels",)),
    ("config/tokenizer/sampling", ("kvlab.config", "kvlab.tokenizer", "kvlab.chat_template", "kvlab.progress",
                                   "kvlab.sampling")),
    ("cache", ("kvlab.cache",)),
    ("model", ("kvlab.model",)),
    ("formats and policies", ("kvlab.hf", "kvlab.gguf", "kvlab.policies")),
    ("loader and generation", ("kvlab.loader", "kvlab.generation")),
    ("prefix cache", ("kvlab.prefix",)),
    ("shared tier and events", ("kvlab.tier", "kvlab.events")),
    ("engine", ("kvlab.engine",)),
    ("sessions", ("kvlab.sessions",)),
    ("verify/fidelity/perplexity", ("kvlab.verify", "kvlab.fidelity", "kvlab.perplexity")),
    ("serve", ("kvlab.serve",)),
    ("cli and the public API", ("kvlab.cli", "kvlab.__main__", "kvlab")),
]
# Formats in the same layer that must not know each other: the hf-or-gguf choice is kvlab/loader.py's.
APART = [("kvlab.hf", "kvlab.gguf"), ("kvlab.gguf", "kvlab.hf")]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported kvlab module) for every import in the file, `from kvlab import x` read as kvlab.x
    when x is a submodule."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvlab"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kvlab":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (ROOT.parent / Path(*sub.split(".")) / "__init__.py").exists()
                found.append((node.lineno, sub if is_module else base))
    return found


def graph() -> list[tuple[str, int, str]]:
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        edges += [(module, line, target) for line, target in imports(path, module)]
    return edges


def test_every_module_is_in_a_layer():
    for path in ROOT.rglob("*.py"):
        layer_of(module_name(path))


def test_no_import_runs_back_up():
    upward = [f"{module}:{line} imports {target} ({LAYERS[layer_of(target)][0]} is above "
              f"{LAYERS[layer_of(module)][0]})"
              for module, line, target in graph() if layer_of(target) > layer_of(module)]
    assert upward == []


def test_hf_and_gguf_do_not_import_each_other():
    crossing = [f"{module}:{line} imports {target}" for module, line, target in graph()
                for a, b in APART if module.startswith(a + ".") and target.startswith(b)]
    assert crossing == []


def documented_layers(text: str) -> list[set[str]]:
    """The folders/modules column of each row of ARCHITECTURE.md's layer table (its first table), bottom first."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layer |"))
    rows = []
    for line in lines[start + 2:]:   # past the header and its rule
        if not line.startswith("|"):
            break
        rows.append(set(re.findall(r"`([^`]+)`", line.split("|")[2])))
    return rows


def doc_name(prefix: str) -> str:
    """kvlab.engine -> `engine/`, kvlab.loader -> `loader.py`, kvlab itself -> `__init__.py`."""
    if prefix == "kvlab":
        return "__init__.py"
    path = ROOT.parent / Path(*prefix.split("."))
    return f"{path.name}/" if path.is_dir() else f"{path.name}.py"


def test_the_architecture_table_lists_these_layers_in_this_order():
    assert documented_layers(ARCHITECTURE.read_text()) == [{doc_name(p) for p in prefixes} for _, prefixes in LAYERS]


def test_every_package_of_kvlab_is_in_the_architecture_table():
    documented = set().union(*documented_layers(ARCHITECTURE.read_text()))
    packages = {f"{p.name}/" for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    modules = {p.name for p in ROOT.glob("*.py")}
    assert (packages | modules) - documented == set()


def test_the_table_reader_sees_a_missing_row():
    """The table check can fail: a table without its tier/events row is not the layer list."""
    text = "\n".join(line for line in ARCHITECTURE.read_text().splitlines() if "`tier/`" not in line)
    assert documented_layers(text) != [{doc_name(p) for p in prefixes} for _, prefixes in LAYERS]


def test_the_scheduler_only_schedules_and_only_the_engine_imports_introspection():
    """Issue 33: sampling, detokenizing and stop rules are the output stage's (engine/output_processor.py), so
    the scheduler imports neither sampling nor the decode loop; introspection.py reads the engine, so no part
    the engine is built from imports it (StepCounters live in engine/counters.py)."""
    edges = graph()
    assert [f"{module}:{line} imports {target}" for module, line, target in edges
            if module == "kvlab.engine.scheduler" and target.startswith(("kvlab.sampling", "kvlab.generation"))] == []
    assert {module for module, _, target in edges if target == "kvlab.engine.introspection"} == {"kvlab.engine.engine"}


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule can fail: an import from kvlab.cache into kvlab.engine is reported."""
    fake = ROOT / "cache" / "paged.py"
    module = module_name(fake)
    (tmp_path / "x.py").write_text("from kvlab.engine.engine import Engine\nfrom kvlab import validate\n")
    found = imports(tmp_path / "x.py", module)
    assert [layer_of(t) > layer_of(module) for _, t in found] == [True, False]


# model/ names no concrete cache class: tests/test_model_seams.py checks the imported names themselves
