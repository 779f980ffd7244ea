"""The `kvlab` command: one module per subcommand, each with `add_parser(subparsers)` and `run(args)`.

Where the output *is* a table (demo, verify, memory) it goes to stdout; where the output is generated text,
the text goes to stdout and stats and progress go to stderr, so stdout stays pipeable.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvlab.errors import KVLabError

# name -> module under kvlab.cli; each module defines add_parser(subparsers) and run(args) -> int
COMMANDS = ["demo", "verify", "memory", "generate", "chat", "perplexity", "serve"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlab", description="An exact, inspectable KV-cache engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"kvlab.cli.{name}").add_parser(sub)
    return parser


def normalize_flags(argv: list[str]) -> list[str]:
    """Accept --max_tokens as well as --max-tokens (vLLM and llama.cpp users type both)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.run(args) or 0)
    except KVLabError as exc:
        print(f"kvlab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
