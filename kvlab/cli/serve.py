"""`kvlab serve [--model PATH]`: an OpenAI-compatible HTTP server on kvlab.Engine, with vLLM's flag names.

Loads the model (default: the one shipped with kvlab), builds one Engine, and serves it with uvicorn:
`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/tokenize`, `/detokenize`, `/reset_prefix_cache`,
`/health`, `/metrics` (Prometheus) and the cache explorer at `/`. On SIGINT/SIGTERM new requests get 503,
requests in flight get `--shutdown-timeout` seconds to finish, then are aborted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvlab.cache.kv_cache import KV_CACHE_DTYPES
from kvlab.cli.engine_stream import add_speculative_flag, speculative_config
from kvlab.cli.model_flags import add_activations_flag
from kvlab.progress import compiling_kernels
from kvlab.serve.limits import DEFAULT_MAX_REQUEST_BYTES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with metrics and a live cache explorer",
                       description="Serve a model over the OpenAI API (completions, chat, streaming) with "
                                   "continuous batching and a prefix cache; open http://HOST:PORT/ for the "
                                   "cache explorer.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("-m", "--model", metavar="PATH", default=None,
                   help="HF model folder (config.json, *.safetensors, tokenizer.json), a .gguf file or a folder "
                        "holding one (default: bundled)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names the model answers to; the first is reported (default: --model as given; for "
                        "a GGUF, its file stem, as llama.cpp's server reports it)")
    p.add_argument("--api-key", default=os.environ.get("KVLAB_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the API (default: $KVLAB_API_KEY)")
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                        help="largest request body; larger ones get 413 while they are read (default "
                             f"{DEFAULT_MAX_REQUEST_BYTES} = 4 MiB)")
    limits.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST",
                        help="Host header names served besides loopback names and IP addresses ('.example.com' "
                             "= it and its subdomains, '*' = any); others get 403 (DNS-rebinding guard)")
    limits.add_argument("--hide-cache-text", action="store_true",
                        help="never show cached tokens or text in /v1/cache/state and the explorer, not even "
                             "unsalted ones (salted blocks are shown only to their own cache_salt anyway)")
    limits.add_argument("--enable-pause", action="store_true",
                        help="serve POST /pause, POST /resume and GET /is_paused (as vLLM's dev mode does): the "
                             "engine stops stepping, requests in flight keep their blocks (default off: any "
                             "caller could stall every request)")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template to use instead of the model's (or where it has none)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute dtype")
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context limit per request (default: the model's max_position_embeddings)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    engine.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                        help="KV pool budget, e.g. 64MiB (default: enough for --max-num-seqs full sequences, "
                             "at most 1 GiB)")
    engine.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (instead of memory); on a "
                        "hybrid model (sliding and full layers) the full-attention layers' blocks")
    engine.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_cache_dtype", default=None,
                        choices=("auto",) + KV_CACHE_DTYPES, metavar="DTYPE",
                        help="KV storage: auto (the compute dtype, the default), float32, float16, bfloat16, "
                             "float64, int8, int4, fp8_e4m3, fp8_e5m2")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share cached prompt blocks across requests (default on)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="most sequences per step (default 64)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="most tokens per step; longer prompts are prefilled in chunks (default 512)")
    engine.add_argument("--kv-policy", default=None, metavar="POLICY",
                        help="a cache policy run inside the engine, so a long chat holds a bounded number of "
                             "blocks: window:W (the last W tokens), sinks:S:W (the first S plus the last W), "
                             "shift:KEEP[:BUDGET]; same outputs as kvlab generate --cache-policy (default: "
                             "exact, every block kept)")
    add_speculative_flag(engine)
    engine.add_argument("--max-waiting", type=int, default=256,
                        help="most requests waiting for admission; more get 429 (default 256)")
    # kvlab tier/events flags (issue 23)
    scale = p.add_argument_group("scale-out")
    scale.add_argument("--kv-tier", action="append", default=None, metavar="URL",
                       help="a K/V tier behind the prefix cache, repeatable, tried in order: "
                            "redis://HOST:PORT/DB or valkey://... (shared by instances; ?ttl=S&timeout=S&retry=S), "
                            "file:///DIR (survives restarts)")
    scale.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help="publish KV cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": true, "
                            "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", \"topic\": \"\"}'")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds requests in flight may finish after SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    add_activations_flag(p)
    p.set_defaults(run=run)


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer, model name) from the flags; bad flags raise KVLabError before anything loads."""
    from kvlab.engine.engine import Engine
    from kvlab.errors import ConfigError
    from kvlab.gguf.loader import gguf_file
    from kvlab.hf.loader import resolve_model_dir
    from kvlab.loader import load

    if args.kv_cache_memory is not None and args.num_blocks is not None:
        raise ConfigError("give --kv-cache-memory or --num-blocks, not both")
    if args.max_waiting < 1:
        raise ConfigError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    tag = getattr(args, "model_tag", None)  # `kvlab serve MODEL`, vLLM's form
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ConfigError(f"two models given: {tag} and --model {args.model}; give one")
        args.model = tag
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    spec = speculative_config(args)  # a bad config names its field before anything loads
    gguf = gguf_file(args.model)
    folder = gguf if gguf is not None else resolve_model_dir(args.model)
    model, tokenizer = load(folder, dtype=args.dtype, activations=args.activations)
    if args.chat_template:
        install_chat_template(tokenizer, Path(args.chat_template))
    kv_dtype = None if args.kv_cache_dtype in (None, "auto") else args.kv_cache_dtype
    engine = Engine(model, tokenizer, block_size=args.block_size, num_blocks=args.num_blocks,
                    kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=kv_dtype,
                    max_model_len=args.max_model_len, kv_tiers=getattr(args, "kv_tier", None),
                    kv_events_config=getattr(args, "kv_events_config", None),
                    kv_policy=getattr(args, "kv_policy", None), speculative_config=spec)
    name = gguf.stem if gguf is not None else args.model if args.model is not None else folder.name
    return engine, tokenizer, name, str(folder)


def kv_pool_summary(engine) -> str:
    """The startup line's KV pool: blocks x block size, and on a hybrid model each KV-cache group's blocks and
    bytes (kvlab/engine/kv_groups.py), so the sliding layers' pools are not left out of what the server holds."""
    from kvlab.cli.fmt import human_bytes

    size = engine.config.block_size
    if len(engine.kv_groups) == 1:
        return f"{engine.block_pool.num_blocks} blocks x {size} tokens"
    parts = [f"{'full' if g.window is None else f'sliding {g.window}'} ({len(g.layers)} layer"
             f"{'s' if len(g.layers) > 1 else ''}) "
             f"{g.pool.num_blocks} blocks, {human_bytes(g.pool.capacity_bytes)}" for g in engine.kv_groups]
    total = sum(g.pool.capacity_bytes for g in engine.kv_groups)
    return f"KV groups x {size} tokens: {'; '.join(parts)} (total {human_bytes(total)})"


def warm_up_engine(engine) -> None:
    """Run throwaway requests through a scratch engine on the same model, cache dtype and block size (a short
    one, then one past PARALLEL_MIN_ROWS key rows), so numba compiles, or loads from its disk cache, every
    prefill and decode kernel a request will call now rather than inside the first request's latency. The
    served engine's pool, prefix cache and metrics are untouched."""
    from kvlab.engine.engine import Engine
    from kvlab.kernels.attention import PARALLEL_MIN_ROWS
    from kvlab.sampling.sampler import SamplingParams

    if not engine.model.ops.compiled:
        return
    size = engine.config.block_size
    longest = max(2, min(PARALLEL_MIN_ROWS + size, engine.max_model_len - 2))
    scratch = Engine(engine.model, None, block_size=size, num_blocks=-(-(longest + 2) // size) + 1,
                     max_num_seqs=1, max_num_batched_tokens=engine.config.max_num_batched_tokens,
                     enable_prefix_caching=False, kv_cache_dtype=engine.kv_cache_dtype,
                     max_model_len=engine.max_model_len)
    for length in (2, longest):
        scratch.generate([[0] * length], SamplingParams(max_tokens=2, ignore_eos=True))


def install_chat_template(tokenizer, path: Path) -> None:
    """Use the Jinja template in `path` for chat (the special-token strings come from the tokenizer)."""
    from kvlab.errors import CheckpointError
    from kvlab.chat_template import ChatTemplate

    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the chat template ({exc.strerror})") from None
    special = {}
    for name, token_id in (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id)):
        if token_id is not None:
            special[name] = tokenizer.token_text(token_id)
    tokenizer.chat_template = ChatTemplate(source, special, origin=str(path))


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvlab.serve.app import create_app
    except ImportError as exc:
        from kvlab.errors import ConfigError
        raise ConfigError(f"kvlab serve needs the serve extra ({exc.name} is missing): "
                          "pip install 'kvlab[serve]'") from None

    engine, tokenizer, name, root = build_engine(args)
    with compiling_kernels(prefix="kvlab serve: "):  # first run only: said here, not paid by the first request
        warm_up_engine(engine)
    names = args.served_model_name or [name]
    app = create_app(engine, tokenizer, model_names=names, model_root=root, api_key=args.api_key or None,
                     max_waiting=args.max_waiting, max_request_bytes=args.max_request_bytes,
                     allowed_hosts=(args.host, *args.allowed_hosts), hide_cache_text=args.hide_cache_text,
                     enable_pause=args.enable_pause)
    engine_loop = app.state.kvlab.engine_loop

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # first signal: drain (503 for new work), then exit
            engine_loop.begin_shutdown(args.shutdown_timeout)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, access_log=False)
    print(f"kvlab serve: {names[0]} on http://{args.host}:{args.port} (explorer at /, metrics at /metrics) | "
          f"{kv_pool_summary(engine)} | max_model_len {engine.max_model_len} | "
          f"prefix caching {'on' if args.enable_prefix_caching else 'off'}"
          + (f" | kv policy {engine.kv_policy}" if engine.kv_policy is not None else "")
          + (f" | speculative {engine.speculator.config.method} k={engine.speculator.config.num_speculative_tokens}"
             if engine.speculator is not None else "")
          + (f" | kv tier {', '.join(engine.cache_listener.tier.names)}" if args.kv_tier else "")
          + (f" | kv events on {engine.cache_listener.events.config.endpoint}"
             if engine.cache_listener is not None and engine.cache_listener.events is not None else "")
          + (" | API key required" if args.api_key else ""), file=sys.stderr, flush=True)
    try:
        Server(config).run()
    finally:
        engine.close(args.shutdown_timeout)  # issue 23: drain the KV tier's write queue, stop KV events
    return 0
