"""Qwen3, SmolLM3, Phi-3/4, Gemma 3 and Gemma 2 from folders transformers itself wrote, against transformers.

Per family (tests/family_checkpoints.py: tiny random checkpoints, every parameter randomized): logits over
a prompt within 1e-4 (max|logit| + 1) of transformers' eager float32 forward, 24 greedy tokens equal to
its `generate`, and every greedy step's logits as close, on the compiled and the NumPy backend; Gemma's
sequences run well past their 6-token window. `kvlab verify` passes on each in float64; the engine's
batched steps give each request of a hybrid (sliding + full) model its tokens alone. Run with `-s` to see
the measured errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvlab
import kvlab.kernels

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from family_checkpoints import FAMILIES, kvlab_run, make_family_checkpoint, parity_errors, transformers_run  # noqa: E402
from test_hf_parity import prompt_ids  # noqa: E402

TOLERANCE = 1e-4  # of max |logit| + 1
NEW_TOKENS = 24
# Phi-3's prompt + tokens stay within its pretraining length (48): past it transformers' generate
# recomputes the whole sequence with the long factors, kvlab rotates each position once (model/rope.py)
PROMPT = {"phi3": 12}
BACKENDS = ("numba", "numpy") if kvlab.kernels.AVAILABLE else ("numpy",)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, folder, prompt ids, transformers' run) per family, built once for the module."""
    name = request.param
    folder = make_family_checkpoint(tmp_path_factory.mktemp(name), name)
    _, tokenizer = kvlab.load(folder, backend="numpy")
    ids = prompt_ids(tokenizer, PROMPT.get(name, 20))
    return name, folder, ids, transformers_run(folder, ids, NEW_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_greedy_tokens_match_transformers(family, backend):
    name, folder, ids, want = family
    model, _ = kvlab.load(folder, backend=backend)
    assert model.config.architecture == FAMILIES[name][0]
    got = kvlab_run(model, ids, NEW_TOKENS)
    errors = parity_errors(got, want)
    print(f"\n{name} ({backend}): max |logit error| / (max |logit| + 1): prompt {errors['prompt']:.1e}, "
          f"{NEW_TOKENS} greedy steps {errors['steps']:.1e}; tokens "
          f"{'identical' if np.array_equal(got['tokens'], want['tokens']) else 'DIFFER'} "
          f"({len(set(want['tokens'].tolist()))} distinct)")
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    assert max(errors.values()) < TOLERANCE, errors


def test_the_hooks_matter(family):
    """Each family's hook, switched off, moves the logits by far more than the tolerance: the parity
    above is not reached by a model that ignores them."""
    name, folder, ids, want = family
    model, _ = kvlab.load(folder, backend="numpy")
    off = {"qwen3": {"qk_norm": False}, "smollm3": {"no_rope_layers": None},
           "phi3": {"partial_rotary_factor": 1.0, "rope_scaling": None},
           "gemma3": {"layer_types": None, "interleaved_sliding_window": None, "rope_local_base_freq": None},
           "gemma2": {"attn_logit_softcapping": None}}[name]
    weights = _weights(folder, model.config)
    changed = kvlab.LlamaModel(model.config.replace(**off), backend="numpy", weights={
        k: v for k, v in weights.items() if not ("q_norm" in k or "k_norm" in k) or "qk_norm" not in off})
    scale = np.abs(want["logits"]).max() + 1
    assert np.abs(changed.forward(ids).logits - want["logits"]).max() / scale > 100 * TOLERANCE


def _weights(folder: Path, config) -> dict[str, np.ndarray]:
    from kvlab.hf.fused import split_fused
    from kvlab.hf.safetensors import load_file
    return split_fused(config, dict(load_file(folder / "model.safetensors")))


def test_verify_passes_in_float64(family):
    name, folder, _, _ = family
    model, _ = kvlab.load(folder, dtype="float64")
    results = kvlab.verify_model(model, length=20) if hasattr(kvlab, "verify_model") else \
        __import__("kvlab.verify.verifier", fromlist=["verify_model"]).verify_model(model, length=20)
    failed = [(r.name, r.max_abs_error, r.tolerance) for r in results if not r.passed]
    assert results and not failed, failed


def test_engine_batched_equals_alone_on_hybrid_models(tmp_path):
    """Gemma 3 (sliding and full layers) in the paged engine: requests batched, chunked and preempted in a
    small pool get the tokens each gets alone, past the window; the pool trims nothing (config.hybrid)."""
    from kvlab import Engine, SamplingParams

    folder = make_family_checkpoint(tmp_path / "g3", "gemma3")
    model, tokenizer = kvlab.load(folder, dtype="float64")
    assert model.config.hybrid and model.config.sliding_window is None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 320, size=n).tolist() for n in (3, 11, 17, 9)]
    alone = [kvlab.generate(model, np.array([p]), 12)[0].tolist() for p in prompts]
    for backend_model in (model, kvlab.load(folder, dtype="float64", backend="numpy")[0]):
        engine = Engine(backend_model, block_size=4, num_blocks=14, max_num_seqs=3, max_num_batched_tokens=7)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        for i in range(len(prompts)):
            assert list(finals[f"r{i}"].outputs[0].token_ids) == alone[i]


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  Whether 'tis nobler?  "}]


@pytest.mark.parametrize("name, variables", [("qwen3", {}), ("qwen3", {"enable_thinking": False}),
                                             ("qwen3", {"enable_thinking": True}), ("gemma3", {})])
def test_chat_templates_render_in_the_sandbox_as_transformers_renders_them(tmp_path, name, variables):
    """Qwen3's template (`enable_thinking`) and Gemma's (the system turn folded into the first user turn),
    written into tokenizer_config.json, render through kvlab's sandboxed jinja exactly as transformers'
    apply_chat_template renders them."""
    import json

    folder = make_family_checkpoint(tmp_path / name, name)
    template = (TEMPLATES / f"{name}.jinja").read_text()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    _, tokenizer = kvlab.load(folder, backend="numpy")
    got = tokenizer.chat_template.render(CHAT, add_generation_prompt=True, **variables)
    want = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True, **variables)
    assert got == want
    if name == "gemma3":
        assert "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>" in got and "system" not in got
    elif variables.get("enable_thinking") is False:
        assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert got.endswith("<|im_start|>assistant\n")
