"""The remote store's connection: an asyncio loop on a thread of its own, and the server link.

    loop = LoopThread("tieredkv-remote")
    link = ServerLink(url, epoch_key, loop, on_epoch=forget_blocks)
    link.up                      # the tier is usable now
    loop.call(coro, timeout)     # run a coroutine on the loop from another thread, and wait
    link.failed(err)             # an operation met a connection fault: the tier goes down
    link.close(); loop.close()

The link is redis-py's asyncio client over a bounded connection pool, with socket timeouts
and no retries inside the client (a fault is reported at once; the store fails the job, the
caller recomputes). A health task checks the server every `health_s` seconds: it brings a down
tier back up, and reads the epoch key, a random token the first engine to find the server empty
writes there. A new epoch means the server lost its blocks (restarted empty, flushed): the store
forgets what it knew was stored. An epoch key holding something other than a string (damaged)
is replaced by a new epoch. Each change of state (down, back up) is logged once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# faults of the link itself (the server is gone or too slow), as opposed to a refused command
LINK_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError, concurrent.futures.TimeoutError)
ANY_ERROR = (RedisError, *LINK_ERRORS)

SOCKET_TIMEOUT_S = 5.0  # one command; a 2 MiB value takes milliseconds
CONNECT_TIMEOUT_S = 1.0
HEALTH_S = 1.0


def redacted(url: str | Sequence[str]) -> str:
    """The URL without its password, for logs (several: comma-separated)."""
    if not isinstance(url, str):
        return ", ".join(redacted(u) for u in url)
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class LoopThread:
    """An asyncio event loop running on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result; TimeoutError after `timeout` s."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def spawn(self, coro: Coroutine[Any, Any, None]) -> concurrent.futures.Future:
        """Start `coro` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def soon(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the loop's thread."""
        self.loop.call_soon_threadsafe(callback)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class ServerLink:
    """The client of one server, whether it is usable now, and the epoch of its blocks."""

    def __init__(self, url: str, epoch_key: str, loop: LoopThread, on_epoch: Callable[[], None],
                 max_connections: int, health_s: float | None = None) -> None:
        """`on_epoch` runs on the loop's thread when the server's blocks are not the ones known
        (first contact, restarted empty, flushed); `health_s`: seconds between health checks
        (default HEALTH_S). ValueError for URL options redis-py refuses."""
        self.url, self.loop, self._epoch_key, self._on_epoch = url, loop, epoch_key, on_epoch
        self.health_s = HEALTH_S if health_s is None else health_s
        self.up = False
        self.epoch: bytes | None = None
        self.faults = 0  # times the link went down
        self._said_down = False
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=SOCKET_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=CONNECT_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
        )  # options in the URL's query (?socket_timeout=2) win over these
        self.client = Redis.from_pool(pool)
        self._health: concurrent.futures.Future | None = None

    def start(self, timeout: float) -> None:
        """Check the server once (waiting up to `timeout` s), then keep checking in the background."""
        try:
            self.loop.call(self.check(), timeout)
        except concurrent.futures.TimeoutError as err:
            self.failed(err)
        self._health = self.loop.spawn(self._check_forever())

    async def check(self) -> None:
        """Ping the server through its epoch key; bring the tier up (or down) accordingly."""
        try:
            epoch = await self._epoch()
        except ANY_ERROR as err:
            self.failed(err)
            return
        if epoch != self.epoch:
            self.epoch = epoch
            self._on_epoch()
        if not self.up:
            # connections made before the outage may be dead (a restarted server): start afresh
            await self.client.connection_pool.disconnect(inuse_connections=True)
            self.up = True
            if self._said_down:
                logger.warning("remote tier %s: reachable again; using it", redacted(self.url))
            else:
                logger.info("remote tier %s: connected", redacted(self.url))
            self._said_down = False

    async def _epoch(self) -> bytes | str:
        """The server's epoch. An empty server gets one from the first engine to see it; so does
        a server whose epoch key holds something other than a string (damaged: its blocks were
        written in no epoch an engine can name)."""
        try:
            epoch = await self.client.get(self._epoch_key)
        except ResponseError as err:
            if not str(err).startswith("WRONGTYPE"):
                raise
            logger.warning("remote tier %s: the epoch key %s is not a string; naming a new epoch",
                           redacted(self.url), self._epoch_key)
            await self.client.delete(self._epoch_key)
            epoch = None
        if epoch is None:
            await self.client.set(self._epoch_key, os.urandom(8).hex(), nx=True)
            epoch = await self.client.get(self._epoch_key)
        return epoch

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_s)
            await self.check()

    def failed(self, err: BaseException) -> None:
        """An operation met `err`: the tier is down until a health check reaches the server
        (loop thread). Said once per outage."""
        was_up, self.up = self.up, False
        if was_up:
            self.faults += 1
        if not self._said_down:
            self._said_down = True
            what = "lost" if was_up or self.epoch is not None else "cannot reach"
            logger.warning("remote tier %s: %s the server (%s); serving without it, retrying every %g s",
                           redacted(self.url), what, describe(err), self.health_s)

    async def aclose(self) -> None:
        if self._health is not None:
            self._health.cancel()
        await self.client.aclose()


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
