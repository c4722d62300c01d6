"""A slow network link to a real redis-server: a loopback TCP relay that passes the server's
replies at `bytes_per_s`, and each piece of the clients' requests `latency_s` late (a pipeline of
commands, sent at once, pays it once: the round trip of a distant server).

    with SlowLink(server.port, bytes_per_s=200_000, latency_s=0.02) as link:
        link.url                  # redis://127.0.0.1:<relay port>/0
"""

from __future__ import annotations

import socket
import threading
import time

PIECE = 4096


class SlowLink:
    """A relay in front of a redis-server on `port`: replies limited to `bytes_per_s`, requests
    delayed by `latency_s`."""

    def __init__(self, port: int, bytes_per_s: float, latency_s: float = 0.0) -> None:
        self.target, self.bytes_per_s, self.latency_s = port, bytes_per_s, latency_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None, self.latency_s), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.bytes_per_s, 0.0), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, bytes_per_s: float | None, latency_s: float) -> None:
        try:
            while data := src.recv(PIECE):
                if bytes_per_s is not None:
                    time.sleep(len(data) / bytes_per_s)
                if latency_s:
                    time.sleep(latency_s)
                dst.sendall(data)
        except OSError:
            pass  # either end closed
        finally:
            dst.close()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            sock.close()
