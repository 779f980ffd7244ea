"""Small formatting helpers shared by the subcommands."""

from __future__ import annotations

import re

from rich.console import Console

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as memory is allocated)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def parse_bytes(text: str) -> int:
    """'80GiB', '8 GB', '1e9', '524288' -> bytes. Raises ValueError naming the text."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte count (try 8GiB, 512MB or 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def console(stderr: bool = False) -> Console:
    """A rich console that fits an 80-column terminal when the real width is unknown (pipes, CI)."""
    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal:
        con = Console(stderr=stderr, highlight=False, width=80)
    return con
