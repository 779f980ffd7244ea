"""`file:///dir`: a local disk tier, so a restarted server starts warm.

One file per block (`dir/ab/<key name>`), written to a temporary file in the same folder and renamed
into place, so a reader sees a whole entry or none, and a crash mid-write leaves only a stray temporary
(which a later write replaces). Contents are checked by the codec on every read, so a file damaged on
disk is refused, never loaded. There is no size bound: prune the folder (oldest first) as you would a
cache.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Sequence
from urllib.parse import unquote, urlsplit

from kvlab.errors import ConfigError
from kvlab.tier.backend import TierUnavailable


class FileTier:
    """A folder of block files."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"--kv-tier {url!r}: a file tier is file:///absolute/folder")
        if parts.query:
            raise ConfigError(f"--kv-tier {url!r}: a file tier takes no parameters")
        self.root = Path(unquote(parts.path))
        self.name = f"file://{self.root}"
        self.retry_s = 5.0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--kv-tier {url!r}: cannot create {self.root} ({exc.strerror})") from None

    def _path(self, name: str) -> Path:
        safe = name.replace(":", "_")  # names are kvlab's own (kvlab:kv:v1:<hex>), never a path
        return self.root / safe[-2:] / safe

    def run_length(self, names: Sequence[str]) -> int:
        run = 0
        for name in names:
            if not self._path(name).is_file():
                break
            run += 1
        return run

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for name in names:
            try:
                values.append(self._path(name).read_bytes())
            except FileNotFoundError:
                values.append(None)
            except OSError as exc:
                raise TierUnavailable(f"{self.name}: {exc}") from None
        return values

    def put(self, name: str, value: bytes) -> bool:
        path = self._path(name)
        if path.exists():
            return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TierUnavailable(f"{self.name}: {exc}") from None
        return True

    def close(self) -> None:
        pass
