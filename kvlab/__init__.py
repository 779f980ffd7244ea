"""kvlab: an exact, inspectable KV-cache inference engine for Llama-family models, in NumPy."""

import os as _os

# OpenBLAS (NumPy's, for prefill products) keeps its threads spinning ~0.1 s after each product; the
# compiled kernels between two products (prefill attention, SwiGLU) then share the cores with a spinner.
# A short spin (2^12 cycles) before sleeping made prefill 6-13% faster here (128-512 tokens, SmolLM2-135M
# shape, 2-core VM), and the decode steps after a prefill too: numba's two threads no longer share a core
# with a spinner (Q8_0 decode 52 -> 112 tok/s on a Zen 4 guest, README "OpenBLAS's spinning threads").
# Read once when OpenBLAS loads, so it only applies if NumPy is not imported yet (the CLI and the server;
# scripts: import kvlab first, or export it); a user's own setting wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")

from kvlab.cache import KVCache, MemoryReport, kv_bytes_per_token
from kvlab.config import ModelConfig, tiny_config
from kvlab.engine.engine import Engine
from kvlab.generation.generate import generate, stream_generate
from kvlab.engine.request import CompletionOutput, RequestOutput
from kvlab.sampling.sampler import SamplingParams
from kvlab.errors import (CacheMismatchError, CheckpointError, ConfigError, ContextLengthError, InputError,
                          KVLabError)
from kvlab.loader import load
from kvlab.model.layers import apply_rope, grouped_attention
from kvlab.model.llama import ForwardOutput, LlamaModel, TinyLlama
from kvlab.sessions.session import Session
from kvlab.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer", "CacheMismatchError", "CheckpointError", "CompletionOutput", "ConfigError",
    "ContextLengthError", "Engine",
    "ForwardOutput", "InputError", "KVCache", "KVLabError", "LlamaModel", "MemoryReport", "ModelConfig",
    "RequestOutput", "SamplingParams", "Session", "TinyLlama", "apply_rope", "generate", "grouped_attention",
    "kv_bytes_per_token", "load", "stream_generate", "tiny_config",
]
