"""The sampling flags of `generate` and `chat`, and their resolution against the model's recommendation.

The flags default to None ("not given"), so `kvlab.sampling.defaults.resolve_sampling` can tell a flag from
a default: flags win, then the model's generation_config.json (or GGUF `general.sampling.*`), then
llama.cpp's defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvlab.sampling.defaults import SAMPLING_KEYS, ResolvedSampling, resolve_sampling

SAMPLING_HELP = ("unset sampling flags take the model's generation_config.json values, else llama.cpp's "
                 "defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", "--temp", type=float, default=None, help="0 = greedy; " + SAMPLING_HELP)
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass, 1.0 = off")
    p.add_argument("--top-k", type=int, default=None, help="0 or -1 = off")
    p.add_argument("--min-p", type=float, default=None, help="0.0 = off")
    p.add_argument("-v", "--verbose", action="store_true", help="say which sampling settings are used, and why")


def sampling_settings(args: argparse.Namespace, model_path: Any, model_known: bool = True) -> ResolvedSampling:
    """The flags over the recommendation of the model at `model_path` (None: the default model).

    A bad flag fails before any model file is read. `model_known=False` (e.g. chat's random TinyLlama)
    skips the model's files.
    """
    from kvlab.loader import model_sampling

    flags = {key: getattr(args, key) for key in SAMPLING_KEYS}
    resolve_sampling(flags)
    return resolve_sampling(flags, model_sampling(model_path) if model_known else None)


# --- structured output (llama.cpp's flags) ------------------------------------------------------------------
def add_grammar_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output", "constrain every answer to a grammar (llama.cpp's flags)")
    g.add_argument("--grammar", metavar="GBNF", default=None,
                   help="a llama.cpp GBNF grammar (root ::= ...) or a Lark grammar (start: ...)")
    g.add_argument("--grammar-file", metavar="FILE", default=None, help="read the grammar from FILE")
    g.add_argument("-j", "--json-schema", metavar="SCHEMA", default=None,
                   help="a JSON schema the answer must validate against, e.g. '{\"type\": \"object\"}'")
    g.add_argument("-jf", "--json-schema-file", metavar="FILE", default=None,
                   help="read the JSON schema from FILE")


def grammar_spec(args: argparse.Namespace) -> Any:
    """The GrammarSpec the flags ask for, checked (no model needed), or None. InputError (exit 2) names the
    flag: two at once, an unreadable file, an invalid grammar or schema, --ignore-eos beside a grammar."""
    from kvlab.errors import InputError
    from kvlab.sampling.grammar import GrammarSpec

    given = [(flag, getattr(args, attr, None)) for flag, attr in
             (("--grammar", "grammar"), ("--grammar-file", "grammar_file"), ("--json-schema", "json_schema"),
              ("--json-schema-file", "json_schema_file"))]
    given = [(flag, value) for flag, value in given if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"give one of {' and '.join(flag for flag, _ in given)}, not both")
    if getattr(args, "ignore_eos", False):
        raise InputError("--ignore-eos cannot be combined with a grammar: the answer ends at the end-of-sequence "
                         "token the grammar allows once it is complete")
    flag, value = given[0]
    if flag.endswith("-file"):
        try:
            with open(value, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{flag} {value}: cannot read it ({exc.strerror if isinstance(exc, OSError) else exc})") \
                from None
    try:
        spec = GrammarSpec.grammar(value) if flag.startswith("--grammar") else GrammarSpec.json_schema(value)
        spec.check()
    except InputError as exc:
        raise InputError(f"{flag}: {exc}") from None
    return spec


def compiled_grammar(args: argparse.Namespace, tokenizer: Any, vocab_size: int, stop_ids: Any) -> Any:
    """The flags' grammar compiled for the loaded model's vocabulary (its EOS ids: `stop_ids`), or None."""
    from kvlab.errors import InputError
    from kvlab.sampling.grammar import compile_grammar, grammar_vocab

    spec = grammar_spec(args)
    if spec is None:
        return None
    try:
        return compile_grammar(spec, grammar_vocab(tokenizer, vocab_size, stop_ids))
    except InputError as exc:
        raise InputError(f"{'--json-schema' if spec.kind == 'json_schema' else '--grammar'}: {exc}") from None
