"""Small formatting helpers shared by the subcommands."""

from __future__ import annotations

import sys

from rich.console import Console

from kvlab.validate import decode_text


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as memory is allocated)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def prompt_tokens_text(total: int, cached: int) -> str:
    """`prompt N tokens (M cached)`: generate's and chat's figure for the prompt, whatever cache the M tokens
    came from (a --prompt-cache file, chat's reused history, the engine's prefix cache), 0 included."""
    return f"prompt {total} tokens ({cached} cached)"


def read_stdin() -> str:
    """All of stdin as UTF-8 text; binary or non-UTF-8 input is an InputError naming the offset."""
    buffer = getattr(sys.stdin, "buffer", None)
    return decode_text(buffer.read(), "stdin") if buffer is not None else sys.stdin.read()


def console(stderr: bool = False) -> Console:
    """A rich console that fits an 80-column terminal when the real width is unknown (pipes, CI)."""
    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal:
        con = Console(stderr=stderr, highlight=False, width=80)
    return con
