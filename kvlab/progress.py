"""The progress bar model loaders show on stderr while weights load (large models only)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

PROGRESS_MIN_BYTES = 64 * 1024 * 1024  # show a progress bar for loads above this


@contextmanager
def weight_progress(total_bytes: int, progress: bool | None = None) -> Iterator[Callable[[int], None]]:
    """Yields `advance(nbytes)`; draws a transient bar when `progress` is True, or is None and the load is
    large. Why transient and on stderr: the bar must never mix into generated text on stdout."""
    show = total_bytes >= PROGRESS_MIN_BYTES if progress is None else progress
    if not show:
        yield lambda nbytes: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("loading weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("load", total=total_bytes)
        yield lambda nbytes: bar.advance(task, nbytes)
