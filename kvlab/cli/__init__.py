"""The `kvlab` command: one module per subcommand, each with `add_parser(subparsers)` and `run(args)`.

Where the output *is* a table (demo, verify, memory) it goes to stdout; where the output is generated text,
the text goes to stdout and stats and progress go to stderr, so stdout stays pipeable.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from kvlab.errors import KVLabError

# name -> module under kvlab.cli; each module defines add_parser(subparsers) and run(args) -> int
COMMANDS = ["demo", "verify", "memory", "generate", "chat", "perplexity", "convert", "quantize", "fidelity",
            "serve"]


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `kvlab generate: error: argument --seed: invalid int value: 'x'`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def unrecognized(self, extra: list[str]) -> NoReturn:
        """A flag this command does not have: its usage (which flags it does have), then the error line."""
        self.print_usage(sys.stderr)
        self.error(f"unrecognized arguments: {' '.join(extra)}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvlab", description="An exact, inspectable KV-cache engine.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also accepted after the command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"kvlab.cli.{name}").add_parser(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that an argument the subcommand does not know is reported by that subcommand, with
    its usage (`kvlab chat --bogus`), not by `kvlab` pointing at the list of commands."""
    args, extra = parser.parse_known_args(argv)
    if extra and any(arg in extra for arg in argv[:argv.index(args.command)]):  # `kvlab --bogus generate`
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].unrecognized(extra)
    return args


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
    """Run one subcommand. Any error is one line on stderr and a non-zero exit code (2: bad input or
    model files, 1: anything else); `--debug` shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv[: argv.index("--") if "--" in argv else len(argv)]
    if debug:
        argv.remove("--debug")
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # the OS handed Python bytes that are not UTF-8 (surrogate-escaped)
            print(f"kvlab: error: argument {i + 1} ({arg!r}) is not valid UTF-8", file=sys.stderr)
            return 2
    args = parse_args(build_parser(), normalize_flags(argv))
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvlab generate ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:
        if debug:
            raise
        print(f"kvlab {args.command}: error: {error_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, KVLabError) else 1


def error_line(exc: BaseException) -> str:
    """One line for the user: kvlab's own errors as they are, anything else with its type and a hint."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, KVLabError):
        return text
    if isinstance(exc, OSError):
        return f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or text}"
    return f"{type(exc).__name__}: {text} (an unexpected error; --debug shows where)"


if __name__ == "__main__":
    sys.exit(main())
