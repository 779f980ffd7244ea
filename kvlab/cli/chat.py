"""`kvlab chat`: a multi-turn chat whose KV cache survives across turns.

Every turn the whole conversation is rendered to token ids (the tokenizer's chat template where it has one,
else plain continuation) and sent to the engine, whose prefix cache computes only what is not cached yet. Replies go to
stdout; after each one, a line of stats goes to stderr: `prompt N tokens (M cached)`, the cache's tokens
and bytes, prefill time and decode speed. Works interactively (prompt, readline history) and piped (one message
or command per input line, no prompt), so it can be scripted and tested.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Iterator, TextIO

from kvlab.cli.checks import check_sampling_flags, draw_seed, drawn_seed_note
from kvlab.cli.engine_stream import (add_kv_tier_flag, add_speculative_flag, engine_for_one, row_bytes,
                                     spec_counts, speculative_config, stream_request, warm_up)
from kvlab.cli.fmt import human_bytes, prompt_tokens_text
from kvlab.cli.model_flags import add_activations_flag
from kvlab.cli.sampling_flags import (add_grammar_flags, add_sampling_flags, compiled_grammar, grammar_spec,
                                      sampling_settings)
from kvlab.sampling.defaults import ResolvedSampling
from kvlab.errors import InputError, KVLabError
from kvlab.model.llama import LlamaModel, TinyLlama
from kvlab.progress import KernelCompiles
from kvlab.sessions.conversation import Conversation
from kvlab.sessions.session_io import read_session, register_session, save_session
from kvlab.sampling.sampler import SamplingParams
from kvlab.tokenizer import ByteTokenizer
from kvlab.validate import decode_text

HELP = """commands:
  /edit TEXT   replace your last message with TEXT and answer again
  /undo        drop the last exchange (your message and the reply)
  /save FILE   write the cache and the conversation to FILE
  /load FILE   restore a conversation saved with /save (the next turn reuses its cache)
  /reset       start a new conversation
  /help        this list
  /quit        leave (also Ctrl-D)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="multi-turn chat that keeps the KV cache across turns",
                       description="Chat with a model; each turn computes only what is not cached yet.",
                       epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", metavar="PATH",
                   help="HF model folder or .gguf file (default: kvlab's bundled model)")
    p.add_argument("--tiny", action="store_true", help="use the seeds' TinyLlama (random weights, bytes)")
    p.add_argument("--tiny-seed", type=int, default=7, help="TinyLlama weight seed (default 7)")
    p.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=64,
                   help="most tokens per reply (default 64)")
    add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (reply i uses seed + i; default 0)")
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default=None,
                   help="cache dtype: float64, float32, float16, bfloat16, int8, int4, fp8_e4m3, fp8_e5m2 "
                        "(default: the model's; quantized caches cannot be /save'd)")
    p.add_argument("--system", default=None, help="a system message (plain continuation: leading text)")
    p.add_argument("--history", metavar="FILE", default=None, help="keep readline history in FILE (TTY)")
    add_activations_flag(p)
    add_grammar_flags(p)
    add_speculative_flag(p)
    add_kv_tier_flag(p)
    p.set_defaults(run=run)


# --- model --------------------------------------------------------------------------------------------------
def load_model(args: argparse.Namespace) -> tuple[LlamaModel, Any, str]:
    """(model, tokenizer, name): --tiny, --model PATH, or the default model (TinyLlama until it exists)."""
    if args.tiny:
        return TinyLlama(seed=args.tiny_seed), ByteTokenizer(), f"TinyLlama(seed={args.tiny_seed})"
    import kvlab
    load = getattr(kvlab, "load", None)
    if args.model is not None:
        if load is None:
            raise KVLabError("--model needs kvlab.load, which this kvlab does not have yet")
        return (*_unpack(load(args.model, activations=args.activations)), str(args.model))
    if load is not None:
        try:
            return (*_unpack(load()), "default model")
        except (KVLabError, FileNotFoundError) as exc:
            print(f"kvlab chat: {exc}; using TinyLlama (random weights)", file=sys.stderr)
    else:
        print("kvlab chat: no default model in this kvlab yet; using TinyLlama (random weights)",
              file=sys.stderr)
    return TinyLlama(seed=args.tiny_seed), ByteTokenizer(), f"TinyLlama(seed={args.tiny_seed})"


def _unpack(loaded: Any) -> tuple[LlamaModel, Any]:
    """kvlab.load's result as (model, tokenizer): a pair, a model with .tokenizer, or an object with both."""
    if isinstance(loaded, tuple) and len(loaded) == 2:
        return loaded
    model = getattr(loaded, "model", loaded)
    tokenizer = getattr(loaded, "tokenizer", None) or getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise KVLabError("the loaded model has no tokenizer")
    return model, tokenizer


def stop_ids(model: LlamaModel, tokenizer: Any) -> list[int]:
    """Every id that ends a reply: the config's eos ids and the tokenizer's."""
    ids = set(model.config.eos_token_ids) | {int(i) for i in getattr(tokenizer, "eos_token_ids", ())}
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return sorted(ids)


class _PrefixDecoder:
    """Fallback streaming decoder: decode everything so far, emit what is new once it is complete."""

    def __init__(self, decode: Any) -> None:
        self._decode, self._ids, self._shown = decode, [], ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if text.endswith("\ufffd") or not text.startswith(self._shown):  # hold an incomplete character
            return ""
        new, self._shown = text[len(self._shown):], text
        return new

    def flush(self) -> str:
        text = self._decode(self._ids)
        return text[len(self._shown):] if text.startswith(self._shown) else ""


def stream_decoder(tokenizer: Any, context: list[int]) -> Any:
    """The tokenizer's incremental decoder (push(id) -> text, flush() -> text) or the fallback."""
    make = getattr(tokenizer, "stream_decoder", None)
    return make(context[-8:]) if make is not None else _PrefixDecoder(tokenizer.decode)


# --- input --------------------------------------------------------------------------------------------------
def input_lines(stdin: TextIO, history: str | None) -> Iterator[str | None]:
    """Lines typed at a prompt with readline editing and history on a TTY; raw lines from a pipe.

    A line that is not UTF-8 text comes out as None (the chat reports it and goes on with its history):
    pipes are read as bytes and decoded line by line, so one bad line cannot end the stream.
    """
    if not stdin.isatty():
        buffer = getattr(stdin, "buffer", None)
        for line in (buffer if buffer is not None else stdin):
            if isinstance(line, bytes):
                try:
                    line = decode_text(line, "line")
                except InputError:
                    yield None
                    continue
            yield line.rstrip("\r\n")
        return
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows without pyreadline
        readline = None
    if readline is not None and history:
        try:
            readline.read_history_file(history)
        except OSError:
            pass
    try:
        while True:
            try:
                yield input("> ")
            except EOFError:
                print(file=sys.stderr)
                return
            except UnicodeDecodeError:
                yield None
    finally:
        if readline is not None and history:
            try:
                readline.write_history_file(history)
            except OSError:
                pass


# --- the chat -----------------------------------------------------------------------------------------------
class Chat:
    """One conversation: its messages, the engine that holds its K/V, and how replies are produced and
    reported.

    Each reply is one engine request for the rendered history (earlier replies as the ids they were
    generated as, never re-encoded), so the prefix cache finds every row of the turns before it.
    `--kv-tier` makes that reach across processes; /save and /load write and read the conversation's blocks
    and messages as a session file (kvlab/sessions/session_io.py)."""

    def __init__(self, model: LlamaModel, tokenizer: Any, args: argparse.Namespace,
                 out: TextIO | None = None, err: TextIO | None = None,
                 sampling: ResolvedSampling | None = None, spec: Any = None) -> None:
        # sys.stdout/stderr are looked up now, not when the module was imported (they may be redirected)
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.sampling = sampling or sampling_settings(args, None, model_known=False)
        self.spec = spec
        self.stop = stop_ids(model, tokenizer)
        self.engine = engine_for_one(model, tokenizer, spec, args.kv_dtype, model.config.max_position_embeddings,
                                     self.stop, kv_tiers=getattr(args, "kv_tier", None))
        warm_up(self.engine, 0)  # says on stderr if kernels compile
        self.conversation = self._fresh()
        self.grammar = compiled_grammar(args, tokenizer, model.config.vocab_size, self.stop)  # every reply
        self.replies = 0
        self.history_ids: list[int] = []  # the ids whose K/V the last reply computed: prompt + reply[:-1]

    def _fresh(self) -> Conversation:
        conversation = Conversation()
        if self.args.system:
            conversation.add("system", self.args.system)
        return conversation

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def close(self) -> None:
        """Drain the K/V tier's writes (a second process reads them)."""
        self.engine.close()

    def handle(self, line: str | None) -> bool:
        """Act on one input line; False means quit. An error is reported and the conversation kept as it was
        before the line (a failed /edit keeps the exchange it would have replaced)."""
        if line is None:
            self.note("error: that line is not valid UTF-8 text; ignored (the conversation is unchanged)")
            return True
        before = list(self.conversation.messages)
        try:
            return self._handle(line)
        except KVLabError as exc:
            self.conversation.messages[:] = before
            self.note(f"error: {exc} (the conversation is unchanged)")
            return True

    def _handle(self, line: str) -> bool:
        if not line.strip():
            return True
        if not line.startswith("/"):
            self.conversation.add("user", line)
            self.reply()
            return True
        command, _, rest = line.partition(" ")
        rest = rest.strip()
        if command in ("/quit", "/exit"):
            return False
        if command == "/help":
            self.note(HELP)
        elif command == "/edit":
            if not rest:
                self.note("usage: /edit TEXT")
            else:
                before = list(self.conversation.messages)
                if not self.conversation.edit_last_user(rest):
                    self.note("(nothing to edit yet)")
                elif not self.reply():
                    self.conversation.messages[:] = before  # the edit did not fit: keep the old exchange
        elif command == "/undo":
            dropped = self.conversation.undo()
            self.note(f"(dropped: {dropped[0]['content']!r})" if dropped else "(nothing to undo)")
        elif command == "/reset":  # a new conversation starts from an empty cache, as a fresh process would
            self.conversation, self.history_ids = self._fresh(), []
            self.engine.reset_prefix_cache()
            self.note("(new conversation)")
        elif command in ("/save", "/load"):
            if not rest:
                self.note(f"usage: {command} FILE")
            else:
                self.save(rest) if command == "/save" else self.load(rest)
        else:
            self.note(f"unknown command {command}; /help lists them")
        return True

    def save(self, path: str) -> None:
        try:
            rows = save_session(self.engine, path, self.history_ids, {"messages": self.conversation.to_json()})
        except KVLabError as exc:
            self.note(f"error: {exc}")
            return
        self.note(f"(saved {rows} tokens, {human_bytes(row_bytes(self.engine, rows))} of K/V, "
                  f"to {path})")

    def load(self, path: str) -> None:
        try:
            saved = read_session(self.engine, path)
            conversation = Conversation.from_json(saved.extra.get("messages", []))
        except (KVLabError, ValueError) as exc:
            self.note(f"error: {exc} (the current conversation is unchanged)")
            return
        self.engine.reset_prefix_cache()  # the loaded conversation replaces this one, as in a fresh process
        cached = register_session(self.engine, saved)
        self.conversation, self.history_ids = conversation, saved.tokens
        self.note(f"(loaded {cached} cached tokens and {len(conversation.messages)} messages from {path})")

    def _fit(self) -> list[int] | None:
        """The conversation's ids with room for a reply, dropping the oldest exchanges if the context is full.

        A message that cannot fit even alone is refused and the history kept.
        """
        context = self.model.config.max_position_embeddings
        need = min(self.args.max_tokens, 16)  # leave room for at least a short reply
        messages = self.conversation.messages
        alone = Conversation([m for m in messages if m["role"] == "system"] + [messages[-1]])
        if len(alone.render(self.tokenizer)) + need > context:
            self.conversation.undo()
            self.note(f"error: the message does not fit the model's context of {context} tokens")
            return None
        ids = self.conversation.render(self.tokenizer)
        while len(ids) + need > context and self.conversation.drop_oldest_exchange():
            self.note("(context full: dropped the oldest exchange; the front changed, so the cache restarts)")
            ids = self.conversation.render(self.tokenizer)
        return ids

    def reply(self) -> bool:
        """Answer the conversation; False (and the message dropped) when it does not fit the context."""
        ids = self._fit()
        if ids is None:
            return False
        a = self.args
        room = self.model.config.max_position_embeddings - len(ids)
        params = SamplingParams(**self.sampling.values, seed=None if a.seed is None else a.seed + self.replies,
                                max_tokens=min(a.max_tokens, room), grammar=self.grammar)  # engine: eos
        self.replies += 1
        new: list[int] = []
        decoder = stream_decoder(self.tokenizer, ids)
        times: list[float] = []

        def on_token(token: int) -> None:
            times.append(time.perf_counter())
            new.append(token)
            self.out.write(decoder.push(token))
            self.out.flush()

        before = spec_counts(self.engine)
        reused = 0
        with KernelCompiles() as compiles:  # what the warm-up did not compile: not timed
            start = time.perf_counter()
            try:
                out = stream_request(self.engine, f"turn-{self.replies}", ids, params, on_token)
                reused = out.num_cached_tokens
            except KeyboardInterrupt:  # stop the reply, keep what was said (its blocks went back to the pool)
                self.note("\n(interrupted)")
        self.out.write(decoder.flush() + "\n")
        self.out.flush()
        self.conversation.add("assistant", self.tokenizer.decode(new), new)
        self.history_ids = ids + new[:-1]
        prefill = (times[0] - start - compiles.seconds_between(start, times[0])) if times else 0.0
        decode = (times[-1] - times[0] - compiles.seconds_between(times[0], times[-1])) if len(times) > 1 else 0.0
        speed = f"{(len(new) - 1) / decode:.1f} tok/s" if decode > 0 else "-"
        tokens = len(self.history_ids)
        drafted = f" · {(spec_counts(self.engine) - before).text()}" if self.spec is not None else ""
        self.note(f"[{prompt_tokens_text(len(ids), reused)} · cache {tokens} tok "
                  f"{human_bytes(row_bytes(self.engine, tokens))} · prefill "
                  f"{prefill * 1e3:.1f} ms · decode {speed}{drafted}"
                  + (f" · kernels compiled {compiles.seconds:.1f} s, not counted" if compiles.count else "") + "]")
        return True


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise InputError("--max-tokens must be >= 1")
    check_sampling_flags(args)  # fail before chatting
    grammar_spec(args)  # a bad grammar or schema too
    spec = speculative_config(args)  # and a bad --speculative-config
    seed_drawn = draw_seed(args)  # -1: a seed drawn now and said, so reply i's seed + i can be repeated
    sampling_settings(args, None, model_known=False)  # a bad flag fails before chatting
    model, tokenizer, name = load_model(args)
    sampling = sampling_settings(args, args.model, model_known=not isinstance(model, TinyLlama))
    chat = Chat(model, tokenizer, args, sampling=sampling, spec=spec)  # its warm-up says if kernels compile
    if sys.stdin.isatty():
        chat.note(f"kvlab chat · {name} · context {model.config.max_position_embeddings} tokens · "
                  f"sampling: {sampling.summary()} · /help for commands, Ctrl-D to leave")
    if args.verbose:
        chat.note(sampling.describe())
    if seed_drawn:
        chat.note(drawn_seed_note(args.seed))
    try:
        for line in input_lines(sys.stdin, args.history):
            if not chat.handle(line):
                break
    finally:
        chat.close()
    return 0
