"""`kvlab generate [--model PATH] "prompt"`: stream a completion to stdout, one stats line to stderr.

Flags follow vLLM and llama.cpp (`-n/--max-tokens`, `--temperature`, `--top-p`, `--top-k`, `--min-p`,
`--seed`, `--kv-cache-dtype`). The engine runs it (kvlab/cli/engine_stream.py) with the pieces here:
`TextStream` prints tokens as they arrive and times them, `check_prompt` refuses a prompt before it is
echoed, `cache_policy` turns --context-shift / --cache-policy into a policy.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

from kvlab.cache.dtypes import KV_CACHE_DTYPES
from kvlab.cli.checks import check_sampling_flags, draw_seed, drawn_seed_note
from kvlab.cli.engine_stream import add_kv_tier_flag, add_speculative_flag, generate_with_engine, speculative_config
from kvlab.cli.fmt import human_bytes, prompt_tokens_text, read_stdin
from kvlab.cli.model_flags import add_activations_flag
from kvlab.cli.sampling_flags import add_grammar_flags, add_sampling_flags, grammar_spec, sampling_settings
from kvlab.errors import ContextLengthError, InputError
from kvlab.progress import KernelCompiles
from kvlab.model.llama import LlamaModel


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete a prompt with a model, streaming the text",
                       description="Complete PROMPT with a model: a Hugging Face folder (config.json, "
                                   "*.safetensors, tokenizer.json) or a GGUF file (llama.cpp's format, its "
                                   "block types kept as stored) of a Llama-family model (default: kvlab's "
                                   "bundled model). Text goes to stdout as it is produced; one line of stats "
                                   "goes to stderr.")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (default: read stdin)")
    p.add_argument("-m", "--model", metavar="PATH", default=None,
                   help="HF model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file "
                        "(default: bundled)")
    p.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=256,
                   help="most new tokens; -1 = until eos or the end of the context (default 256)")
    add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0: runs are reproducible)")
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default=None,
                   choices=KV_CACHE_DTYPES, metavar="DTYPE",
                   help="KV cache storage: float32, float16, bfloat16, float64, int8, int4, fp8_e4m3, "
                        "fp8_e5m2 (default: the compute dtype)")
    p.add_argument("--context-shift", action="store_true",
                   help="when the context is full, keep --keep prompt tokens, drop the oldest half of the rest "
                        "and go on (llama.cpp's context shift; off by default, as in llama.cpp)")
    p.add_argument("--keep", type=int, default=0,
                   help="with --context-shift: prompt tokens never discarded, after <bos> (-1 = all; default 0)")
    p.add_argument("--cache-policy", metavar="SPEC", default=None,
                   help="evict by a policy instead: window:W, sinks:S:W, shift:KEEP[:BUDGET]")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="compute dtype (default float32)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--no-display-prompt", action="store_true",
                   help="print only the generated text (default: the prompt first, as llama.cpp does)")
    p.add_argument("--prompt-cache", metavar="FILE", default=None,
                   help="reuse the KV cache saved in FILE for the prompt's common prefix, then save the "
                        "prompt and the new tokens back to it (llama.cpp's --prompt-cache)")
    add_activations_flag(p)
    add_grammar_flags(p)
    add_speculative_flag(p)
    add_kv_tier_flag(p)
    p.set_defaults(run=run)


# --- pieces -------------------------------------------------------------------------------------------------
@dataclass
class GenerationStats:
    """What one run did, for the stats line (and for tests)."""

    prompt_tokens: int
    computed_prompt_tokens: int
    prefill_seconds: float
    new_tokens: int
    decode_seconds: float
    cache_tokens: int
    cache_bytes: int
    cache_dtype: str
    stop_reason: str
    compile_seconds: float = 0.0  # numba compiling kernels (warm-up and run), kept out of the figures above

    def line(self) -> str:
        reused = self.prompt_tokens - self.computed_prompt_tokens
        prefill_rate = self.computed_prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0
        steps = max(self.new_tokens - 1, 0)  # the first token comes from the prefill's logits
        decode = (f"decode {self.new_tokens} tokens, {1e3 * self.decode_seconds / steps:.1f} ms/token "
                  f"({steps / self.decode_seconds:.1f} tok/s)" if steps and self.decode_seconds > 0
                  else f"decode {self.new_tokens} tokens")
        return (prompt_tokens_text(self.prompt_tokens, reused)
                + f" | prefill {1e3 * self.prefill_seconds:.1f} ms ({prefill_rate:.0f} tok/s) | {decode} | "
                f"cache {self.cache_tokens} tokens, {human_bytes(self.cache_bytes)} {self.cache_dtype} | "
                f"stop: {self.stop_reason}"
                + (f" | kernels compiled {self.compile_seconds:.1f} s (first run; cached on disk)"
                   if self.compile_seconds > 0 else ""))


class TextStream:
    """Prints the text of tokens as they arrive (whole characters only) and times prefill and decode.

    Call `start()` just before the prompt is computed; pass `on_token` to whatever yields tokens.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], out: TextIO = sys.stdout,
                 stop_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder(prompt_ids)
        self.out = out
        self.stop_ids = frozenset(stop_ids)
        self.tokens: list[int] = []
        self.started = self.first_token_at = self.last_token_at = 0.0
        self._ends_with_newline = True

    def start(self) -> None:
        self.started = time.perf_counter()

    def on_token(self, token: int) -> None:
        now = time.perf_counter()
        if not self.tokens:
            self.first_token_at = now
        self.last_token_at = now
        self.tokens.append(int(token))
        if int(token) not in self.stop_ids:
            self._write(self.decoder.push(int(token)))

    def finish(self) -> None:
        """Print what the decoder held back and end the output with a newline."""
        self._write(self.decoder.flush())
        if not self._ends_with_newline:
            self._write("\n")

    def write_prompt(self, text: str) -> None:
        """Echo the prompt text as given, so the continuation reads on from it."""
        self._write(text)

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self._ends_with_newline = text.endswith("\n")

    def stats(self, prompt_tokens: int, computed_prompt_tokens: int, cache_tokens: int, cache_bytes: int,
              cache_dtype: str, stop_reason: str, compiles: KernelCompiles | None = None) -> GenerationStats:
        """`compiles`: numba's compiles during the run, whose time is taken out of prefill and decode."""
        compiles = compiles or KernelCompiles()
        prefill = (self.first_token_at - self.started) if self.tokens else 0.0
        decode = self.last_token_at - self.first_token_at
        return GenerationStats(
            prompt_tokens=prompt_tokens, computed_prompt_tokens=computed_prompt_tokens,
            prefill_seconds=prefill - compiles.seconds_between(self.started, self.first_token_at),
            new_tokens=len(self.tokens),
            decode_seconds=decode - compiles.seconds_between(self.first_token_at, self.last_token_at),
            cache_tokens=cache_tokens, cache_bytes=cache_bytes, cache_dtype=cache_dtype,
            stop_reason=stop_reason, compile_seconds=compiles.seconds)


def check_prompt(prompt: Sequence[int], context: int, policy: Any = None) -> None:
    """InputError / ContextLengthError for a prompt that cannot be continued: checked before anything is
    printed, so a refused prompt is not echoed first."""
    if not prompt:
        raise InputError("the prompt is empty: there is nothing to continue")
    if len(prompt) > context and policy is None:
        raise ContextLengthError(f"the prompt is {len(prompt)} tokens but the model's context is {context} "
                                 "tokens (max_position_embeddings in config.json)")


def chat_template_hint(tokenizer: Any, chat: bool) -> str | None:
    """The stderr note for a model with a chat template run without --chat, or None.

    kvlab generate is a completion command (llama.cpp's llama-completion; its llama-cli turns conversation
    mode on by itself when a template exists): the prompt is continued as raw text unless --chat says to
    render it as a user message. An instruct model given a raw instruction often ends it at once (EOS
    after one token, nothing printed), so say that --chat exists rather than change what the command does."""
    if chat or getattr(tokenizer, "chat_template", None) is None:
        return None
    return ("note: this model has a chat template; the prompt is continued as raw text. Add --chat to send "
            "it as a user message through the template (instruct models expect that).")


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(text)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    if rendered is None:
        raise InputError("--chat: this model has no chat template (chat_template.jinja or tokenizer_config.json)")
    return tokenizer.encode(rendered, add_bos=False)


def cache_policy(args: argparse.Namespace, model: LlamaModel, prompt: Sequence[int], tokenizer: Any) -> Any:
    """The eviction policy the flags ask for, or None: --context-shift keeps <bos> plus --keep prompt
    tokens (llama.cpp's n_keep) and discards half of the rest when the context is full."""
    from kvlab.policies.parse import parse_policy
    from kvlab.policies.shift import ContextShift

    context = model.config.max_position_embeddings
    if args.context_shift and args.cache_policy:
        raise InputError("choose --context-shift or --cache-policy, not both")
    if args.cache_policy:
        return parse_policy(args.cache_policy, context)
    if not args.context_shift:
        return None
    if args.keep < -1:
        raise InputError(f"--keep must be >= 0, or -1 for the whole prompt (got {args.keep})")
    bos = int(bool(prompt) and prompt[0] == getattr(tokenizer, "bos_token_id", None))
    n_keep = len(prompt) if args.keep == -1 else min(len(prompt), args.keep + bos)
    if n_keep >= context // 2:
        raise InputError(f"--keep {args.keep} keeps {n_keep} tokens of a {context}-token context: keep fewer "
                         "than half, so each shift frees room")
    return ContextShift(n_keep, context)


def stop_token_ids(model: LlamaModel, tokenizer: Any) -> list[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", ()) or ()) | set(model.config.eos_token_ids)
    return sorted(ids)


def open_stream(args: argparse.Namespace, tokenizer: Any, text: str, prompt: list[int], stop: list[int],
                resolved: Any, seed_drawn: bool) -> "TextStream":
    """What generate says before the first token: the chat-template hint, the echoed prompt,
    and (-v) the sampling settings; the stream the completion is written to."""
    hint = chat_template_hint(tokenizer, args.chat)
    if hint:
        print(hint, file=sys.stderr, flush=True)
    stream = TextStream(tokenizer, prompt, sys.stdout, stop)
    if not (args.chat or args.no_display_prompt):
        stream.write_prompt(text)
    if args.verbose:
        print(resolved.describe(), file=sys.stderr, flush=True)
        if seed_drawn:
            print(drawn_seed_note(args.seed), file=sys.stderr, flush=True)
    return stream


# --- the command --------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from kvlab.loader import load

    text = args.prompt if args.prompt is not None else read_stdin()
    if args.max_tokens == 0 or args.max_tokens < -1:
        raise InputError(f"--max-tokens must be >= 1, or -1 for no limit (got {args.max_tokens})")
    check_sampling_flags(args)  # fail before loading
    grammar_spec(args)  # a bad grammar or schema fails before loading too
    spec = speculative_config(args)  # and a bad --speculative-config
    if args.prompt_cache and (args.context_shift or args.cache_policy):  # refused before loading
        raise InputError("--prompt-cache cannot be combined with --context-shift or --cache-policy: a "
                         "shifted cache no longer matches the prompt's token prefix")
    if args.prompt_cache and Path(args.prompt_cache).is_dir():
        raise InputError(f"{args.prompt_cache}: cannot read (Is a directory)")
    seed_drawn = draw_seed(args)
    resolved = sampling_settings(args, args.model)
    model, tokenizer = load(args.model, dtype=args.dtype, activations=args.activations)
    prompt = encode_prompt(tokenizer, text, args.chat)
    policy = cache_policy(args, model, prompt, tokenizer)
    return generate_with_engine(args, model, tokenizer, text, prompt, spec, resolved, seed_drawn, policy)
