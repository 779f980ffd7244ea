"""llama.cpp's prompt lookup decoding (`llama-lookup`, examples/lookup/lookup.cpp) on one prompt, and its plain
decode of the same prompt: the peer of kvlab's {"method": "ngram"} in bench/bench_speculative.py.

The plain run is the same binary with drafting off (`--spec-draft-n-max 0`): the same tokenizer call, the same
greedy sampler, the same loop and the same timers, one token per forward. Each run is a fresh process (the
model is loaded and warmed up before llama.cpp's own timers start); its stderr reports, among others,

    encoded   57 tokens in    0.120 seconds, speed:  475.000 t/s
    decoded   97 tokens in    0.800 seconds, speed:  121.250 t/s
    n_draft      = 5
    n_predict    = 97
    n_drafted    = 60
    n_accept     = 40

and its stdout echoes the prompt, token by token, then the generated text (then four newlines).

How llama-lookup guesses (common/ngram-cache.cpp), against vLLM's ngram proposer:
  * it counts, for every 1- to 4-gram of the prompt and of the output so far (LLAMA_NGRAM_MIN 1 and
    LLAMA_NGRAM_MAX 4, compile-time constants, no flags), which token followed it how often, and drafts the
    most frequent follower of the longest n-gram that has enough evidence (a 1-gram needs 2 sightings and a
    66 % majority, a 2-gram 2 and 50 %, a 3- or 4-gram one sighting); it then extends the draft token by
    token, each from the n-grams ending in the draft so far. vLLM copies the tokens that followed the most
    recent match of the last prompt_lookup_max..prompt_lookup_min tokens. So prompt_lookup_max = 4 matches,
    prompt_lookup_min is 1 with stricter rules for short n-grams, and num_speculative_tokens is
    `--spec-draft-n-max` (default 3; `--draft`/`--draft-max` are removed in this version and exit).
  * it is not adaptive: a miss drafts nothing (like vLLM), but no back-off after rejected guesses.
  * one sequence only: there is no batched lookup to compare with kvlab's batch 8.
  * `-n N` stops once more than N tokens are sampled, and accepted guesses may run past it (up to N + K):
    the run reports how many it decoded; `run_lookup` asks for tokens - 1 so a plain run decodes exactly
    `tokens`. Compare a lookup text with a plain one on their common length.
  * `--ignore-eos` bans end-of-generation tokens (logit bias -inf); vLLM's and kvlab's ignore_eos emit them
    and go on, so texts can differ after the first end-of-turn token.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

BINARY = "llama-lookup"
_TIMING = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([0-9.]+) seconds")
_COUNT = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s+=\s+(-?\d+)\s*$", re.M)  # after a log prefix


@dataclass(frozen=True)
class LookupRun:
    """One llama-lookup run as it reports itself (prefill and decode timed apart, model load excluded)."""

    prompt_tokens: int   # "encoded N tokens": the prompt as llama.cpp tokenized it (BOS included if it added one)
    prefill_s: float
    tokens: int          # n_predict: tokens sampled, the first from the prompt's last row
    decode_s: float
    draft_max: int       # n_draft: --spec-draft-n-max (0 = plain decode)
    drafted: int         # guesses verified
    accepted: int        # guesses kept
    text: str            # the generated text (stdout after the echoed prompt), "" when it could not be cut out

    @property
    def decode_tokens_per_s(self) -> float:
        """llama.cpp's own "speed" of the decoded line."""
        return self.tokens / self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens over prefill + decode: kvlab's bench counts a `generate` call's wall time, prefill included."""
        return self.tokens / (self.prefill_s + self.decode_s)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def find_binary(given: str | None) -> Path | None:
    """llama-lookup in the folder `given`, else in $LLAMA_CPP_BIN; None when neither holds it."""
    folder = given or os.environ.get("LLAMA_CPP_BIN")
    if not folder:
        return None
    path = Path(folder) / BINARY
    return path if path.is_file() and os.access(path, os.X_OK) else None


def parse_lookup(stdout: str, stderr: str, prompt: str = "") -> LookupRun:
    """A LookupRun from llama-lookup's streams. `prompt`: the prompt as passed; stdout echoes it (as token
    pieces, after two newlines) before the generated text, which is cut out after it when the echo matches."""
    timings = {kind: (int(n), float(s)) for kind, n, s in _TIMING.findall(stderr)}
    counts = {name: int(value) for name, value in _COUNT.findall(stderr)}
    missing = [name for name in ("encoded", "decoded") if name not in timings]
    missing += [name for name in ("n_draft", "n_predict", "n_drafted", "n_accept") if name not in counts]
    if missing:
        raise ValueError(f"llama-lookup output lacks {', '.join(missing)}: {stderr.strip()[-1500:]}")
    if counts["n_predict"] != timings["decoded"][0]:
        raise ValueError(f"llama-lookup reports n_predict {counts['n_predict']} but decoded "
                         f"{timings['decoded'][0]} tokens")
    text = ""
    head = stdout.find(prompt) if prompt else -1
    if head >= 0:
        text = stdout[head + len(prompt):]
        text = text[:-4] if text.endswith("\n" * 4) else text  # lookup.cpp's two closing LOG("\n\n")
    return LookupRun(prompt_tokens=timings["encoded"][0], prefill_s=timings["encoded"][1],
                     tokens=counts["n_predict"], decode_s=timings["decoded"][1], draft_max=counts["n_draft"],
                     drafted=counts["n_drafted"], accepted=counts["n_accept"], text=text)


def lookup_command(binary: Path, model: Path, prompt: str, *, tokens: int, threads: int, draft_max: int,
                   n_ctx: int) -> list[str]:
    """The command line: the prompt raw (llama-lookup applies no chat template; --no-escape keeps its
    backslashes), greedy, end-of-generation banned, `threads` for decode and prefill alike."""
    return [str(binary), "-m", str(model), "-p", prompt, "--no-escape", "-n", str(tokens - 1),
            "--spec-draft-n-max", str(draft_max), "--temp", "0", "--top-k", "1", "--ignore-eos",
            "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "--color", "off", "--seed", "0"]


def run_lookup(binary: Path, model: Path, prompt: str, *, tokens: int, threads: int, draft_max: int,
               n_ctx: int = 2048, env: Mapping[str, str] | None = None, timeout: float = 600) -> LookupRun:
    """One llama-lookup run; `draft_max` 0 is the plain decode. Raises RuntimeError with its stderr on failure
    (a model path it cannot open makes this version die of SIGSEGV after logging why: checked first)."""
    if not Path(model).is_file():
        raise FileNotFoundError(model)
    command = lookup_command(binary, model, prompt, tokens=tokens, threads=threads, draft_max=draft_max,
                             n_ctx=n_ctx)
    out = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout,
                         env=dict(env) if env is not None else None)
    if out.returncode != 0:
        raise RuntimeError(f"{binary.name} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return parse_lookup(out.stdout, out.stderr, prompt)
