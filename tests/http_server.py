"""`tieredkv serve`'s application, really served on a free loopback port from a thread.

    with running_server(AsyncLLM(model="tiny-llama"), "tiny") as server:
        server.client()                  # the official openai client
        server.metrics()                 # /metrics samples by name
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai

from tieredkv import AsyncLLM
from tieredkv.serve.app import build_app
from tieredkv.serve.server import listen, make_server, url_of


@dataclass
class Server:
    url: str
    allm: AsyncLLM

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict[str, float]:
        """The samples of /metrics by name, with the `variant` and `model_name` labels dropped
        (`name{outcome="abort"}` keeps its other labels)."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                key = re.sub(r',?(variant|model_name)="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
                out[key] = float(value)
        return out

    def settled(self, timeout_s: float = 10.0) -> dict[str, float]:
        """/metrics once no request runs or waits."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["tieredkv_requests_running"] == m["tieredkv_requests_waiting"] == 0 or time.monotonic() > deadline:
                return m
            time.sleep(0.02)


@contextmanager
def running_server(allm: AsyncLLM, name: str) -> Iterator[Server]:
    """Serve `allm` as `name` until the block ends (closing the engine with the server)."""
    sock = listen("127.0.0.1", 0)
    uvicorn_server = make_server(build_app(allm, name))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uvicorn_server.started:
        time.sleep(0.01)
    try:
        yield Server(url_of(sock), allm)
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"
