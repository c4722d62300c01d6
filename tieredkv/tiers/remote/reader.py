"""Block reads at the server's speed: pipelined GETs on connections of their own, one per reader
thread, each value received straight into the caller's buffers.

    reads = DirectReads(url, threads=4)
    future = reads.submit(fn, *args)          # fn runs on a reader thread
    for got in reads.get(keys, heads, bodies):  # on a reader thread: one pipeline of GETs
        ...                                   # True: received; None: no such key; False: not a block value
    reads.unlink(keys); reads.reset(); reads.close()

A value is received as `| head | body |`: its first len(head) bytes into `head`, the rest into
`body` (a view of the destination block, pinned memory when the CPU tier is pinned), by
`recv_into` in pieces of at most RECV_CHUNK_BYTES. Nothing is copied but the reply lines and
the few value bytes that arrive with them. redis-py (with the hiredis parser) makes each
connection (URL options, TLS, AUTH, SELECT) and sends the commands; the replies it would parse
into a `bytes` object per value (one copy; its asyncio streams made four more, all on one thread)
are read here, on as many threads as connections (`recv_into` releases the GIL). A connection
found closed by the server when it is next used (a server restarted with its blocks keeps its
epoch, so nothing else tells) is made anew before the pipeline is sent.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import InvalidResponse
from redis.retry import Retry

T = TypeVar("T")

# the most bytes one recv_into asks for. On loopback (bench_remote.py --read-sweep, 2 cores) pieces
# of 64 KiB to 4 MiB read alike, within the noise, for blocks of 256 KiB to 4 MiB (2.0-2.5 GB/s);
# 8 MiB blocks read at 1.4 GB/s whatever the piece
RECV_CHUNK_BYTES = 1 << 20
LINE_BUFFER_BYTES = 64 << 10  # reply lines, and the value bytes that arrive with one


class _Replies:
    """GET replies read from one connection's socket (RESP2 or RESP3)."""

    def __init__(self, connection: redis.Connection) -> None:
        self.connection = connection
        self.sock = connection._sock  # made and set up (AUTH, SELECT) by redis-py; read here
        self._buf = bytearray(LINE_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the bytes received and not consumed: _buf[_start:_end]

    @property
    def drained(self) -> bool:
        return self._start == self._end

    def stale(self) -> bool:
        """Whether the idle connection can be read from: the server closed it (it restarted, with
        its blocks or without) or sent what nobody asked for; either way it is of no use."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def value(self, head: memoryview, body: memoryview) -> bool | None:
        """The next reply: True if a value of exactly len(head) + len(body) bytes was received
        into them, None for no such key, False for any other value or an error reply."""
        line = self._line()
        if line[:1] == b"$":
            size = int(line[1:])
            if size < 0:
                return None
            if size != len(head) + len(body):
                self._skip(size + 2)
                return False
            self._into(head)
            self._into(body)
            self._skip(2)  # the value's CRLF
            return True
        if line == b"_":  # RESP3 null
            return None
        if line[:1] == b"-":
            return False
        raise InvalidResponse(f"unexpected reply to GET: {line[:40]!r}")

    def _recv(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            if self._start == 0:
                raise InvalidResponse(f"a reply line longer than {len(self._buf)} bytes")
            kept = self._end - self._start
            self._buf[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        n = self.sock.recv_into(self._view[self._end :])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        self._end += n

    def _line(self) -> bytes:
        while (i := self._buf.find(b"\r\n", self._start, self._end)) < 0:
            self._recv()
        line = bytes(self._view[self._start : i])
        self._start = i + 2
        return line

    def _into(self, dst: memoryview) -> None:
        have = min(len(dst), self._end - self._start)
        dst[:have] = self._view[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < len(dst):
            n = self.sock.recv_into(dst[pos : pos + RECV_CHUNK_BYTES])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            pos += n

    def _skip(self, count: int) -> None:
        while count:
            if self._start == self._end:
                self._recv()
            step = min(count, self._end - self._start)
            self._start += step
            count -= step


class DirectReads:
    """Reader threads, each with a connection of its own to one server (module docstring)."""

    def __init__(self, url: str, threads: int, socket_timeout_s: float, connect_timeout_s: float) -> None:
        """ValueError for URL options redis-py refuses. Connections are made when first used."""
        self._pool = redis.ConnectionPool.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s, retry=Retry(NoBackoff(), 0),
        )  # options in the URL's query win over these
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tieredkv-remote-read")
        self._local = threading.local()  # each thread's _Replies and the generation it was made in
        self._lock = threading.Lock()
        self._generation = 0  # bumped by reset(): connections of older generations are remade
        self._open: list[redis.Connection] = []

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run `fn(*args)` on a reader thread."""
        return self._executor.submit(fn, *args)

    def get(self, keys: Sequence[str], heads: Sequence[memoryview], bodies: Sequence[memoryview]
            ) -> Iterator[bool | None]:
        """GET the keys in one pipeline (reader thread); each reply's outcome as it is received
        (`_Replies.value`). Consume them all: a connection left mid-reply, or that met an
        error, is closed."""
        replies = self._replies()
        done = False
        try:
            replies.connection.send_packed_command(replies.connection.pack_commands([("GET", k) for k in keys]),
                                                   check_health=False)
            for head, body in zip(heads, bodies, strict=True):
                yield replies.value(head, body)
            done = replies.drained
        finally:
            if not done:
                self._drop(replies)

    def unlink(self, keys: Sequence[str]) -> None:
        """Delete the keys (reader thread)."""
        replies = self._replies()
        try:
            replies.connection.send_command("UNLINK", *keys, check_health=False)
            replies.connection.read_response()
        except BaseException:
            self._drop(replies)
            raise

    def reset(self) -> None:
        """Remake every connection before its next use (the server may be another process now)."""
        with self._lock:
            self._generation += 1

    def close(self) -> None:
        """Finish what was submitted, then disconnect."""
        self._executor.shutdown(wait=True)
        with self._lock:
            for connection in self._open:
                connection.disconnect()
            self._open.clear()

    def _replies(self) -> _Replies:
        replies: _Replies | None = getattr(self._local, "replies", None)
        if replies is not None and (self._local.generation != self._generation or replies.stale()):
            self._drop(replies)
            replies = None
        if replies is None:
            connection = self._pool.make_connection()
            connection.connect()
            with self._lock:
                self._open.append(connection)
                self._local.generation = self._generation
            replies = self._local.replies = _Replies(connection)
        return replies

    def _drop(self, replies: _Replies) -> None:
        self._local.replies = None
        replies.connection.disconnect()
        with self._lock:
            if replies.connection in self._open:
                self._open.remove(replies.connection)
