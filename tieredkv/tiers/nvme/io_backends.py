"""Block I/O backends of the NVMe store, each a `BlockIO` (`block_io.py`: the interface the
store calls, and the seam where tests inject faults).

Backends: `SyncBackend` (os.preadv / os.pwritev on a thread pool), `AiofilesBackend` (the
same calls through aiofiles on a private event loop), `UringBackend` (io_uring through the
liburing bindings, zero-copy from the caller's memory), and `FaultyBackend` (wraps another
and fails, cuts short or refuses chosen requests). `make_backend(name)` builds one by name and
falls back to `sync`, with one warning, where io_uring cannot be used.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cache
from typing import Literal, get_args

from tieredkv.tiers.nvme.block_io import BlockIO, IOCompletion, IOOp, IORequest

logger = logging.getLogger(__name__)

IOBackend = Literal["uring", "aiofiles", "sync"]  # the one list of backend names
def _run_request(req: IORequest) -> int:
    """Do one request with a blocking syscall: bytes moved, or -errno."""
    try:
        if req.op == "read":
            return os.preadv(req.fd, req.buffers, req.offset)
        return os.pwritev(req.fd, req.buffers, req.offset)
    except OSError as exc:
        return -(exc.errno or errno.EIO)


class _QueueReaper:
    """Completions handed over from worker threads through a queue."""

    def __init__(self) -> None:
        self._done: queue.SimpleQueue[IOCompletion] = queue.SimpleQueue()

    def reap(self, timeout: float | None) -> list[IOCompletion]:
        try:
            out = [self._done.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out


class SyncBackend(_QueueReaper, BlockIO):
    """os.preadv / os.pwritev on `threads` worker threads (the syscalls release the GIL)."""

    name = "sync"

    def __init__(self, threads: int = 8) -> None:
        super().__init__()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tieredkv-io")

    def submit(self, requests: Sequence[IORequest]) -> None:
        for req in requests:
            self._pool.submit(self._run, req)

    def _run(self, req: IORequest) -> None:
        self._done.put(IOCompletion(req.tag, _run_request(req)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class AiofilesBackend(_QueueReaper, BlockIO):
    """The same syscalls awaited through `aiofiles.os.wrap` on a private event-loop thread."""

    name = "aiofiles"

    def __init__(self, threads: int = 8) -> None:
        import aiofiles.os

        super().__init__()
        self._preadv = aiofiles.os.wrap(os.preadv)
        self._pwritev = aiofiles.os.wrap(os.pwritev)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tieredkv-aio")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tieredkv-aio-loop", daemon=True
        )
        self._thread.start()

    def submit(self, requests: Sequence[IORequest]) -> None:
        for req in requests:
            asyncio.run_coroutine_threadsafe(self._run(req), self._loop)

    async def _run(self, req: IORequest) -> None:
        call = self._preadv if req.op == "read" else self._pwritev
        try:
            result = await call(req.fd, req.buffers, req.offset, executor=self._pool)
        except OSError as exc:
            result = -(exc.errno or errno.EIO)
        self._done.put(IOCompletion(req.tag, result))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._pool.shutdown(wait=True)


Fault = Literal["raise", "error", "short"]


class FaultyBackend(BlockIO):
    """Wraps a backend and spoils chosen requests, for tests of the failure paths.

    `inject("write", "raise", errno.ENOSPC)` makes the submit of the next write raise (none
    of the requests submitted with it starts, as `BlockIO.submit` says); `"error"` completes it
    with -errno without doing it; `"short"` does all but its last `short_by` bytes and reports
    that count. (The store submits a load's reads in one call, other requests one a call.)
    """

    def __init__(self, inner: BlockIO, short_by: int = 4096) -> None:
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self._short_by = short_by
        self._plan: list[tuple[IOOp, Fault, int]] = []
        self._errors: list[IOCompletion] = []
        self._lock = threading.Lock()

    def inject(self, op: IOOp, fault: Fault, err: int = errno.EIO, count: int = 1) -> None:
        """Spoil the next `count` requests of kind `op`."""
        with self._lock:
            self._plan.extend([(op, fault, err)] * count)

    def _take(self, op: IOOp) -> tuple[Fault, int] | None:
        with self._lock:
            for i, (planned_op, fault, err) in enumerate(self._plan):
                if planned_op == op:
                    del self._plan[i]
                    return fault, err
        return None

    def submit(self, requests: Sequence[IORequest]) -> None:
        faults = [self._take(req.op) for req in requests]
        raised = [err for fault, err in filter(None, faults) if fault == "raise"]
        if raised:  # before any request starts
            raise OSError(raised[0], f"injected: {os.strerror(raised[0])}")
        passed = []
        for req, fault in zip(requests, faults, strict=True):
            if fault is None:
                passed.append(req)
            elif fault[0] == "error":
                with self._lock:
                    self._errors.append(IOCompletion(req.tag, -fault[1]))
            else:
                passed.append(replace(req, buffers=_cut(req.buffers, self._short_by)))
        if passed:
            self.inner.submit(passed)

    def reap(self, timeout: float | None) -> list[IOCompletion]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors + self.inner.reap(0 if errors else timeout)

    def close(self) -> None:
        self.inner.close()


def _cut(buffers: tuple[memoryview, ...], nbytes: int) -> tuple[memoryview, ...]:
    """The buffers without their last `nbytes` bytes."""
    out = list(buffers)
    while nbytes and out:
        last = out.pop()
        keep = max(last.nbytes - nbytes, 0)
        nbytes -= last.nbytes - keep
        if keep:
            out.append(last[:keep])
    return tuple(out)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def make_backend(name: IOBackend, queue_depth: int = 32, directory: str | None = None) -> BlockIO:
    """The backend called `name`; `uring` falls back to `sync` (one warning) where unusable.

    `directory` is where the io_uring probe tries its I/O (the store's directory).
    """
    if name not in get_args(IOBackend):
        choices = ", ".join(map(repr, get_args(IOBackend)))
        raise ValueError(f"io_backend: {name!r} is not allowed; choose one of {choices}")
    threads = min(queue_depth, 16)
    if name == "sync":
        return SyncBackend(threads)
    if name == "aiofiles":
        return AiofilesBackend(threads)
    usable, why = uring_probe(directory)
    if usable:
        try:
            from tieredkv.tiers.nvme.uring_backend import UringBackend

            return UringBackend(queue_depth)
        except (ImportError, OSError, RuntimeError) as exc:
            why = f"setting up a ring failed: {exc!r}"
    _warn_once(
        "uring", f"io_uring is not usable here ({why}); the NVMe store uses the 'sync' backend"
    )
    return SyncBackend(threads)


# Runs in a child process, without torch or tieredkv (fast to start): the calls UringBackend
# makes, on page-aligned numpy buffers like the store's, O_DIRECT where the directory allows it.
_PROBE = r"""
import errno, os, sys, tempfile, numpy as np, liburing as L
ring, cqe = L.Ring(), L.Cqe()
L.io_uring_queue_init(8, ring, 0)
efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
L.io_uring_register_eventfd(ring, efd)
def aligned(n):
    raw = np.zeros(n + 4096, np.uint8)
    return raw[-raw.ctypes.data % 4096 :][:n]
def run(op, fd, bufs, tag):
    sqe = L.io_uring_get_sqe(ring)
    iov = L.Iovec([memoryview(b) for b in bufs])
    (L.io_uring_prep_readv if op == "r" else L.io_uring_prep_writev)(sqe, fd, iov, 0)
    L.io_uring_sqe_set_data64(sqe, tag)
    L.io_uring_sqe_set_flags(sqe, L.IOSQE_ASYNC)
    L.io_uring_submit(ring)
    L.io_uring_wait_cqe(ring, cqe)
    got = []
    for _ in L.CqeIter(ring, cqe):
        entry = cqe[0]
        try:
            got.append((entry.user_data, entry.res))
        except OSError as exc:
            got.append((entry.user_data, -exc.errno))
    L.io_uring_cq_advance(ring, len(got))
    return got
src, dst = aligned(8192), aligned(8192)
src[:] = np.arange(8192) % 251
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as d:
    path = os.path.join(d, "probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
    assert run("w", fd, [src[:4096], src[4096:]], 7) == [(7, 8192)]
    assert run("r", fd, [dst], 8) == [(8, 8192)] and (src == dst).all()
    assert run("r", -1, [dst], 9) == [(9, -errno.EBADF)]
    os.close(fd)
L.io_uring_unregister_eventfd(ring)
L.io_uring_queue_exit(ring)
print("ok")
"""


@cache
def uring_probe(directory: str | None = None) -> tuple[bool, str]:
    """(usable, why not): io_uring through the liburing bindings, tried in a child process.

    A child process, because a binding built for another CPU dies of SIGILL, which no
    `except` can catch.
    """
    try:
        args = [sys.executable, "-c", _PROBE, directory or tempfile.gettempdir()]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"probe did not run: {exc!r}"
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return True, ""
    if done.returncode < 0:
        return False, f"the liburing bindings crash with {signal.Signals(-done.returncode).name}"
    return False, (done.stderr.strip().splitlines() or ["probe failed"])[-1]
