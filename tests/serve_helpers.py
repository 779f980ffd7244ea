"""A real `kvlab serve` subprocess for tests: a free loopback port, /health polled, stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-m", "kvlab", "serve"]
START_TIMEOUT_S = 90
# the shipped model has no chat template: the server tests give it this one (role: content lines)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, name: str, log: Any) -> bool:
    """Poll `url`/health until it answers 200 (True) or `timeout_s` passes (False); RuntimeError with the
    process's `log()` if it exits first. A start-up wait, bounded: no assertion races it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


class ServerProcess:
    """`kvlab serve ARGS` on 127.0.0.1; `stop()` ends exactly the process this started."""

    def __init__(self, *args: str, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        full_env = {k: v for k, v in os.environ.items() if k != "KVLAB_API_KEY"}
        full_env.update(env or {})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*SERVE, "--host", "127.0.0.1", "--port", str(self.port),
                                          "--log-level", "warning", *args],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        if not wait_healthy(self.url, self.proc, START_TIMEOUT_S, "kvlab serve", self.log):
            self.stop()
            raise RuntimeError(f"kvlab serve did not become healthy in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal the server and wait; the exit status (uvicorn re-raises SIGTERM after a graceful
        shutdown, so a clean stop reads as 0 or -SIGTERM; see `clean_exit`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    # --- reading the server -------------------------------------------------------------------------------
    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        """POST `body` as JSON ({} when None: every POST needs a JSON body)."""
        return httpx.post(f"{self.url}{path}", json={} if body is None else body, timeout=60, **kw)

    def cache_state(self, **kw: Any) -> dict[str, Any]:
        response = self.get("/v1/cache/state", **kw)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 15.0, **kw: Any) -> dict[str, Any]:
        """The cache state once no request is left and no block is referenced (fails after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.cache_state(**kw)
            if not state["requests"] and state["num_used_blocks"] == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: {state['requests']}, "
                                     f"{state['num_used_blocks']} blocks in use")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Every kvlab: sample without labels other than model_name, by sample name."""
        text = self.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if set(sample.labels) <= {"model_name"}:
                    out[sample.name] = sample.value
        return out


def chat_server(tmp: Path, *flags: str) -> "ServerProcess":
    """`kvlab serve --dtype float64 --chat-template CHAT_TEMPLATE FLAGS...` on the shipped model, logging
    into `tmp` (float64: the engine's tokens do not depend on the batch they run in)."""
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    return ServerProcess("--dtype", "float64", "--chat-template", str(tmp / "chat.jinja"), *flags, log_dir=tmp)


def clean_exit(status: int) -> bool:
    return status in (0, -signal.SIGTERM)


class InProcessServer:
    """`create_app(...)` served by uvicorn on a thread of this process (127.0.0.1, a free port), for tests
    that must reach inside the engine (inject a fault, watch threads). `stop()` ends it and joins."""

    def __init__(self, app: Any) -> None:
        import threading

        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    @property
    def engine_loop(self) -> Any:
        return self.app.state.kvlab.engine_loop

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json={} if body is None else body, timeout=60, **kw)
