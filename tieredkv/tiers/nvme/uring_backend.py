"""The io_uring backend of the NVMe store, through the liburing Python bindings.

`submit` prepares one readv/writev SQE per request over an `Iovec` of the caller's buffers
(no copy) and enters the kernel once per batch; at most `queue_depth` requests are in the
ring, the rest wait in a backlog that completions drain. Every SQE is marked IOSQE_ASYNC, so
the kernel's workers start the transfer: these bindings call `io_uring_submit` holding the GIL,
and a 2 MiB request started inside it held the GIL 100-300 us, stalling the engine loop
(marked, the call returns in a few us). The kernel signals completions on an
eventfd registered with the ring: `reap` sleeps in select() on it (releasing the GIL whatever
the bindings do) and drains the completion queue with `CqeIter` and one `io_uring_cq_advance`
(in these bindings `cqe[i]` does not wrap around the ring, so it is never indexed past 0).
The bindings' `Iovec` never lets go of a buffer it is given (it keeps a reference for good): a
view of a tensor handed to it would keep the tensor's memory alive, and one new view an I/O
would pile up objects for the garbage collector to walk. So it is given only views of the
backend's own (`_Views`): one a range of memory, made the first time and owning nothing.

Operations: `UringBackend.submit`, `.reap`, `.close`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from tieredkv.tiers.nvme.block_io import BlockIO, IOCompletion, IORequest

logger = logging.getLogger(__name__)


MAX_VIEWS = 1 << 17  # ranges kept: the CPU tier's blocks and the store's buffers are far fewer


class _Views:
    """For each range of memory (address, length), one memoryview of it made the first time,
    which owns nothing: an I/O's buffers stay alive through its job until it completes, and the
    bindings keep the view, not the memory. Past `MAX_VIEWS` ranges a view is made for each
    use (the bindings keep each: a small object an I/O, never the memory)."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], memoryview] = {}

    def __call__(self, buffer: memoryview) -> memoryview:
        key = (ctypes.addressof(ctypes.c_char.from_buffer(buffer)), buffer.nbytes)
        view = self._views.get(key)
        if view is None:
            view = memoryview((ctypes.c_char * key[1]).from_address(key[0])).cast("B")
            if len(self._views) < MAX_VIEWS:
                self._views[key] = view
        return view


class UringBackend(BlockIO):
    """Vectored reads and writes through one io_uring; raises OSError/ImportError if unusable."""

    name = "uring"

    def __init__(self, queue_depth: int = 32) -> None:
        import liburing

        self._lib = liburing
        self._ring = liburing.Ring()
        liburing.io_uring_queue_init(queue_depth, self._ring, 0)
        self._efd = -1
        try:
            self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            liburing.io_uring_register_eventfd(self._ring, self._efd)
        except OSError:
            if self._efd >= 0:
                os.close(self._efd)
            liburing.io_uring_queue_exit(self._ring)
            raise
        self._cqe = liburing.Cqe()
        self._depth = queue_depth
        self._lock = threading.Lock()  # the submission queue, _inflight and _backlog
        self._inflight: dict[int, tuple[IORequest, Any]] = {}  # tag -> (request, its Iovec)
        self._backlog: deque[IORequest] = deque()
        self._views = _Views()
        self._closed = False

    def submit(self, requests: Sequence[IORequest]) -> None:
        with self._lock:
            self._backlog.extend(requests)
            self._fill()

    def _fill(self) -> None:
        """Move backlog requests into free SQEs and hand them to the kernel (lock held)."""
        lib = self._lib
        while self._backlog and len(self._inflight) < self._depth:
            req = self._backlog[0]
            # before taking an SQE: a failure here leaves none half-made
            iov = lib.Iovec([self._views(buffer) for buffer in req.buffers])
            sqe = lib.io_uring_get_sqe(self._ring)
            if sqe is None:
                break
            self._backlog.popleft()
            if req.op == "read":
                lib.io_uring_prep_readv(sqe, req.fd, iov, req.offset)
            else:
                lib.io_uring_prep_writev(sqe, req.fd, iov, req.offset)
            lib.io_uring_sqe_set_data64(sqe, req.tag)
            lib.io_uring_sqe_set_flags(sqe, lib.IOSQE_ASYNC)
            self._inflight[req.tag] = (
                req,
                iov,
            )  # the kernel reads the iovec and buffers until completion
        if lib.io_uring_sq_ready(self._ring):
            try:
                lib.io_uring_submit(self._ring)
            except OSError as exc:  # EAGAIN/EBUSY: the SQEs stay queued; the next reap retries
                logger.warning("io_uring_submit failed (%s); retrying on the next completion", exc)

    def reap(self, timeout: float | None) -> list[IOCompletion]:
        lib = self._lib
        if not lib.io_uring_cq_ready(self._ring):
            select.select([self._efd], [], [], timeout)
        try:
            os.read(self._efd, 8)  # reset before draining: a CQE posted later signals again
        except BlockingIOError:
            pass
        done = []
        for _ in lib.CqeIter(self._ring, self._cqe):
            entry = self._cqe[0]  # CqeIter moves entry 0 along the ring
            try:
                result = entry.res
            except OSError as exc:  # the bindings raise for a negative res
                result = -(exc.errno or errno.EIO)
            done.append(IOCompletion(entry.user_data, result))
        if done:
            lib.io_uring_cq_advance(self._ring, len(done))
        with self._lock:
            for completion in done:
                del self._inflight[completion.tag]
            self._fill()
        return done

    def close(self) -> None:
        if self._closed:
            return
        while self._inflight:  # never free a ring the kernel still writes into our buffers through
            self.reap(0.1)
        self._closed = True
        self._lib.io_uring_unregister_eventfd(self._ring)
        self._lib.io_uring_queue_exit(self._ring)
        os.close(self._efd)
