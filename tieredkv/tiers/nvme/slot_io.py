"""Slot I/O of the NVMe store: a job moves one block between caller memory and one slot.

A job is one vectored request, header then payload. It goes straight from (to) the caller's
memory when that memory suits O_DIRECT, else through an aligned bounce buffer; at most
`queue_depth` bounce buffers exist, and jobs that need one queue for it, so a burst of
unaligned blocks costs bounded memory. A completion thread reaps the backend, verifies reads
(every header field, the header checksum, the payload xxh3) and calls `on_done(job, fault)`:
fault is None, or the name of the stats counter of what went wrong: a disk fault, or
`internal_errors` for a bug met while checking a job (logged at ERROR; the test suite fails on it).

Operations: `SlotJob`, `SlotIO.start`, `SlotIO.in_flight`, `SlotIO.close`.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from tieredkv.tiers.nvme.io_backends import BlockIO, IOOp, IORequest
from tieredkv.tiers.nvme.slot_format import (
    AlignedBufferPool,
    SlotGeometry,
    SlotHeader,
    byte_view,
    header_matches,
    pack_header,
    parse_header,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how long the completion thread sleeps in reap() before looking for close()


@dataclass(eq=False)
class SlotJob:
    """One block read or write; `payload` is the caller's block as uint8."""

    id: int
    op: IOOp
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    slot: int
    fd: int
    generation: int  # which incarnation of the store file the slot belongs to
    payload: torch.Tensor
    header: torch.Tensor | None = None  # aligned header_bytes, from a pool
    bounce: torch.Tensor | None = None  # aligned copy of the payload, when one is needed
    nbytes: int = 0  # bytes the request moves


class SlotIO:
    """Runs SlotJobs through a backend on behalf of the store."""

    def __init__(
        self,
        backend: BlockIO,
        geometry: SlotGeometry,
        fingerprint: bytes,
        queue_depth: int,
        on_done: Callable[[SlotJob, str | None], None],
    ) -> None:
        self.backend, self.geometry = backend, geometry
        self._fingerprint, self._on_done = fingerprint, on_done
        self._headers = AlignedBufferPool(geometry.header_bytes)
        self._bounces = AlignedBufferPool(geometry.payload_bytes, limit=queue_depth)
        self._lock = threading.Lock()
        self._jobs: dict[int, SlotJob] = {}  # started, not done
        self._waiting: deque[SlotJob] = deque()  # for a bounce buffer
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._complete_loop, name="tieredkv-nvme", daemon=True
        )
        self._thread.start()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs) + len(self._waiting)

    def start(self, job: SlotJob, header: SlotHeader | None, direct: bool) -> None:
        """Start `job` (writes pass their header); `direct`: the payload memory suits O_DIRECT."""
        job.header = self._headers.get()
        if header is not None:
            pack_header(byte_view(job.header), header)
        if direct:
            self._issue(job)
            return
        with self._lock:
            self._waiting.append(job)
        self._start_waiting()

    def close(self) -> None:
        """Stop the completion thread once every started job is done; close the backend."""
        self._stop.set()
        self._thread.join()
        self.backend.close()

    def _start_waiting(self) -> None:
        """Start jobs waiting for a bounce buffer, while there are free ones."""
        while True:
            with self._lock:
                bounce = self._bounces.get() if self._waiting else None
                if bounce is None:
                    return
                job = self._waiting.popleft()
            job.bounce = bounce
            if job.op == "write":
                n = job.payload.numel()
                bounce[:n].copy_(job.payload)
                bounce[n:].zero_()
            self._issue(job)  # if that fails, the job is done and its buffer free again

    def _issue(self, job: SlotJob) -> None:
        body = job.payload if job.bounce is None else job.bounce
        buffers = (byte_view(job.header), byte_view(body))
        job.nbytes = sum(b.nbytes for b in buffers)
        offset = self.geometry.slot_offset(job.slot)
        with self._lock:
            self._jobs[job.id] = job
        try:
            self.backend.submit([IORequest(job.id, job.op, job.fd, offset, buffers)])
        except OSError as exc:
            with self._lock:
                del self._jobs[job.id]
            self._done(job, "enospc" if exc.errno == errno.ENOSPC else "io_errors")

    def _complete_loop(self) -> None:
        while not (self._stop.is_set() and self.in_flight == 0):
            for completion in self.backend.reap(_POLL_S):
                with self._lock:
                    job = self._jobs.pop(completion.tag, None)
                if job is None:
                    logger.error(
                        "NVMe store: internal error: completion of unknown job %d ignored",
                        completion.tag,
                    )
                    continue
                try:
                    fault = self._outcome(job, completion.result)
                except Exception:  # a bug, not a disk fault: counted apart; the job fails so
                    # that its waiters do not hang, and this thread lives on for the others
                    logger.exception("NVMe store: internal error while checking job %d", job.id)
                    fault = "internal_errors"
                self._done(job, fault)
                self._start_waiting()

    def _done(self, job: SlotJob, fault: str | None) -> None:
        self._on_done(job, fault)
        self._headers.put(job.header)
        if job.bounce is not None:
            self._bounces.put(job.bounce)

    def _outcome(self, job: SlotJob, result: int) -> str | None:
        """None if the job succeeded, else the stats counter of its fault (verifies reads)."""
        if result < 0:
            return "enospc" if result == -errno.ENOSPC else "io_errors"
        if result != job.nbytes:
            return "short_reads" if job.op == "read" else "short_writes"
        if job.op == "write":
            return None
        g = self.geometry
        header = parse_header(byte_view(job.header), g.block_size)
        expected = (job.block_hash, job.parent_hash, job.token_ids, g.block_bytes)
        if not header_matches(header, self._fingerprint, *expected):
            return "corrupt"
        body = job.payload if job.bounce is None else job.bounce[: job.payload.numel()]
        if xxhash.xxh3_64_intdigest(byte_view(body)) != header.payload_checksum:
            return "corrupt"
        if job.bounce is not None:
            job.payload.copy_(body)
        return None
