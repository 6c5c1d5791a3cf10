"""`shardlm serve` as a subprocess for tests: a free 127.0.0.1 port, a bounded wait for /health, a stop that
always happens (SIGTERM, then SIGKILL of the whole process group), and the server's log for failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

KEY = "sk-shardlm-test"
NAME = "smol"


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `shardlm serve` process; use as a context manager (started and ready on enter, stopped on exit)."""

    def __init__(self, *args: str, env: dict | None = None, api_key: str | None = KEY, ready_s: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--served-model-name", NAME, *args]
        if api_key:
            self.args += ["--api-key", api_key]
        self.env = {**os.environ, **(env or {})}
        self.ready_s = ready_s
        self.log = tempfile.NamedTemporaryFile("w+", prefix="shardlm-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._log_text: str | None = None

    def start(self) -> "Server":
        """Start the process (returns at once; `wait_ready` waits for /health)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "shardlm", "serve", *self.args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        return self

    def wait_ready(self) -> None:
        """Poll /health until 200; fails with the server's log when it exits or the wait runs out."""
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"shardlm serve exited {self.proc.returncode} while loading:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"shardlm serve was not ready after {self.ready_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM and wait for the exit status; SIGKILL the process group after `timeout` seconds."""
        if self.proc is None or self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.returncode = self.proc.wait(timeout=30)
            raise AssertionError(f"shardlm serve ignored SIGTERM for {timeout:.0f} s:\n{self.tail(20000)}")
        finally:
            self._reap_group()
            self._drop_log()
        return self.returncode

    def _reap_group(self, grace_s: float = 5.0) -> None:
        """SIGKILL what is left of the server's process group, after `grace_s` seconds in which it may end by
        itself (multiprocessing's resource tracker unlinks the queues' semaphores as it exits)."""
        deadline = time.monotonic() + grace_s
        try:
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)  # raises once no process of the group is left
                time.sleep(0.05)
            os.killpg(self.proc.pid, signal.SIGKILL)  # ranks left behind would hold ports and memory
        except ProcessLookupError:
            pass

    def _drop_log(self) -> None:
        """Keep the log's text for `tail` and remove its file."""
        if self._log_text is None:
            self._log_text = self.tail(20000)
            self.log.close()
            os.unlink(self.log.name)

    def tail(self, chars: int = 4000) -> str:
        """The end of the server's log."""
        if self._log_text is not None:
            return self._log_text[-chars:]
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-chars:]

    def rank_pids(self) -> list[int]:
        """PIDs of the server's rank processes (named shardlm-rank<rank>, runtime/worker.py)."""
        import psutil

        kids = psutil.Process(self.proc.pid).children(recursive=True)
        return [k.pid for k in kids if k.name().startswith("shardlm-rank")]

    def client(self, **kw):
        """An openai.OpenAI client for this server."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def post(self, path: str, body: dict, key: str | None = KEY, timeout: float = 120) -> httpx.Response:
        """A plain POST (for errors the openai client would turn into exceptions). The body is sent as json.dumps
        writes it (non-ASCII as escapes), so a test can send what httpx's own encoder refuses: a lone surrogate."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        return httpx.post(self.url + path, content=json.dumps(body), headers=headers, timeout=timeout)

    def stats(self) -> dict:
        """GET /stats."""
        return httpx.get(self.url + "/stats", timeout=10).json()

    def __enter__(self) -> "Server":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def sse_events(lines) -> list[dict | str]:
    """The `data:` payloads of an SSE body's lines, JSON decoded ("[DONE]" kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
