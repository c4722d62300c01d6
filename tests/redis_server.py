"""A real `redis-server` for tests: a free loopback port, a temporary directory, no persistence.

    server = RedisServer(tmp_path); server.start()
    server.url; server.client()        # a plain redis-py client, to inject faults
    server.kill(); server.start()      # killed, then back empty on the same port
    server.pause(); server.resume()    # SIGSTOP / SIGCONT: a server that hangs
    server.stop()
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

REDIS_SERVER = shutil.which("redis-server")
START_TIMEOUT_S = 10.0


def require_redis_server() -> str:
    """The redis-server binary; skips the test without one (fails it in CI, which installs it)."""
    if REDIS_SERVER is None:
        message = "redis-server not found: apt-get install redis-server"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return REDIS_SERVER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on a fixed loopback port, restartable (empty) on that port."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.binary = require_redis_server()
        self.directory = directory
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "the server runs already"
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--save", "", "--appendonly", "no", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if self.client().ping():
                    return
            except Exception as err:  # not listening yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not start: {err}") from err
            time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def block_keys(self) -> list[bytes]:
        """Every block value the engines stored (not the epoch key)."""
        return [k for k in self.client().scan_iter(match="tieredkv:*", count=1000) if not k.endswith(b":epoch")]

    def kill(self) -> None:
        """SIGKILL: gone at once, with everything it held."""
        assert self.proc is not None, "the server is not running"
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.resume()  # a paused server does not handle SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def wait_until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met after {timeout_s} s")
        time.sleep(0.05)
