"""Slot I/O of the NVMe store: a job moves one block between caller memory and one slot.

`start(job)` only hands the job over, so the caller (the engine loop) never waits for the disk
nor spends time on a block's bytes: a read of an open file, while fewer than `queue_depth` jobs
are in flight, goes straight to the backend (which never waits for I/O); `start_all(jobs)` hands
several over, and those reads go to the backend in one call (one io_uring_submit for a load
plan's blocks, not one a block); every other job queues for an issuing thread, which takes reads
before writes and keeps at most `queue_depth` jobs in flight: a write waiting here never delays
a read submitted after it. It prepares each job (a write's payload xxh3 and header; a copy into
an aligned bounce buffer where the caller's memory does not suit O_DIRECT) and submits it as one
vectored request, header then payload. A completion thread reaps the backend, verifies reads
(every header field, the header checksum, the payload xxh3) and calls `on_done([(job, fault),
...])` once for each batch it reaped: fault is None, or the name of the stats counter of what
went wrong: a disk fault, or `internal_errors` for a bug met while handling a job (logged at
ERROR; the test suite fails on it).

Operations: `SlotJob`, `SlotIO.start`, `SlotIO.start_all`, `SlotIO.in_flight`, `SlotIO.close`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from tieredkv.tiers.nvme.block_io import BlockIO, IOOp, IORequest, fault_of
from tieredkv.tiers.nvme.slot_format import (
    ALIGN,
    AlignedBufferPool,
    SlotGeometry,
    SlotHeader,
    byte_view,
    header_matches,
    is_aligned,
    pack_header,
    parse_header,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how long the completion thread sleeps in reap() before looking for close()


@dataclass(eq=False)
class SlotJob:
    """One block read or write; `payload` is the caller's block as uint8. `fd` is -1 when the
    job's file is still to be made (the last one was lost): `open_file` makes it at issue."""

    id: int
    op: IOOp
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    slot: int
    generation: int  # which incarnation of the store file the slot belongs to
    payload: torch.Tensor
    fd: int = -1
    o_direct: bool = False  # the file takes O_DIRECT: memory must be aligned
    write_header: SlotHeader | None = None  # a write's header, its payload checksum made at issue
    header: torch.Tensor | None = None  # aligned header_bytes, from a pool
    bounce: torch.Tensor | None = None  # aligned copy of the payload, when one is needed
    nbytes: int = 0  # bytes the request moves


class SlotIO:
    """Runs SlotJobs through a backend on behalf of the store (module docstring).

    `open_file(job)`: called on the issuing thread for a job with no file (`fd == -1`); sets
    its `fd` and `o_direct`, or returns the fault the job fails with."""

    def __init__(
        self,
        backend: BlockIO,
        geometry: SlotGeometry,
        fingerprint: bytes,
        queue_depth: int,
        on_done: Callable[[list[tuple[SlotJob, str | None]]], None],
        open_file: Callable[[SlotJob], str | None],
    ) -> None:
        self.backend, self.geometry, self.queue_depth = backend, geometry, queue_depth
        self._fingerprint, self._on_done, self._open_file = fingerprint, on_done, open_file
        self._headers = AlignedBufferPool(geometry.header_bytes)
        self._bounces = AlignedBufferPool(geometry.payload_bytes, limit=queue_depth)
        self._cond = threading.Condition()
        self._queued: dict[IOOp, deque[SlotJob]] = {"read": deque(), "write": deque()}
        self._issued: dict[int, SlotJob] = {}  # taken by the issuing thread, not done
        self._stop = False
        self._threads = [
            threading.Thread(target=self._issue_loop, name="tieredkv-nvme-issue", daemon=True),
            threading.Thread(target=self._complete_loop, name="tieredkv-nvme", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._pending()

    def _pending(self) -> int:
        return len(self._issued) + len(self._queued["read"]) + len(self._queued["write"])

    def start(self, job: SlotJob) -> None:
        """Hand `job` over (a write carries its `write_header`); returns at once."""
        self.start_all([job])

    def start_all(self, jobs: Sequence[SlotJob]) -> None:
        """Hand the jobs over, in order, as `start` each; the reads that go straight to the
        backend go in one `submit` (one io_uring_submit for the lot). Returns at once."""
        now = []
        with self._cond:
            for job in jobs:
                if job.op == "read" and job.fd >= 0 and len(self._issued) < self.queue_depth:
                    self._issued[job.id] = job
                    now.append(job)
                else:
                    self._queued[job.op].append(job)
            if len(now) < len(jobs):
                self._cond.notify_all()
        if now:  # buffers and a submit: no file I/O, nothing to wait for
            self._issue(now)

    def close(self) -> None:
        """Stop the threads once every started job is done; close the backend."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self.backend.close()

    # ---------------------------------------------------------------- issuing

    def _issue_loop(self) -> None:
        while (job := self._next_job()) is not None:
            self._issue([job])

    def _issue(self, jobs: list[SlotJob]) -> None:
        """Prepare the jobs taken for issue and submit those that are ready, in one call."""
        ready = []
        for job in jobs:
            try:
                fault = self._prepare(job)
            except Exception:  # a bug, not a disk fault: the job fails, the thread lives on
                logger.exception("NVMe store: internal error while preparing job %d", job.id)
                fault = "internal_errors"
            if fault is not None:
                self._done([(job, fault)])
            else:
                ready.append(job)
        if ready:
            self._submit(ready)

    def _next_job(self) -> SlotJob | None:
        """The next job to issue, reads first, once fewer than `queue_depth` are in flight;
        None once closed and nothing is queued."""
        queued = self._queued
        with self._cond:
            self._cond.wait_for(
                lambda: (queued["read"] or queued["write"]) and len(self._issued) < self.queue_depth
                or (self._stop and not (queued["read"] or queued["write"]))
            )
            queue = queued["read"] or queued["write"]
            if not queue:
                return None
            job = queue.popleft()
            self._issued[job.id] = job
        return job

    def _prepare(self, job: SlotJob) -> str | None:
        """Buffers, checksum and header of `job`; the fault it fails with, or None."""
        if job.fd < 0 and (fault := self._open_file(job)) is not None:
            return fault
        job.header = self._headers.get()
        if self.geometry.block_bytes % ALIGN or (job.o_direct and not is_aligned(job.payload)):
            job.bounce = self._bounces.get()  # never None: at most queue_depth jobs are issued
        if job.op == "write":
            checksum = xxhash.xxh3_64_intdigest(byte_view(job.payload))
            pack_header(byte_view(job.header), dataclasses.replace(job.write_header, payload_checksum=checksum))
            if job.bounce is not None:
                n = job.payload.numel()
                job.bounce[:n].copy_(job.payload)
                job.bounce[n:].zero_()
        return None

    def _submit(self, jobs: list[SlotJob]) -> None:
        """One vectored request per job, header then payload, all in one backend call; if it
        raises, none of them started, and each fails with the fault."""
        requests = []
        for job in jobs:
            body = job.payload if job.bounce is None else job.bounce
            buffers = (byte_view(job.header), byte_view(body))
            job.nbytes = sum(b.nbytes for b in buffers)
            requests.append(IORequest(job.id, job.op, job.fd, self.geometry.slot_offset(job.slot), buffers))
        try:
            self.backend.submit(requests)
        except OSError as exc:
            self._done([(job, fault_of(exc.errno)) for job in jobs])

    # ---------------------------------------------------------------- completing

    def _complete_loop(self) -> None:
        while True:
            with self._cond:
                if self._stop and not self._pending():
                    return
            completions = self.backend.reap(_POLL_S)
            with self._cond:
                jobs = [self._issued.get(completion.tag) for completion in completions]
            finished = []
            for completion, job in zip(completions, jobs, strict=True):
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
                finished.append((job, fault))
            if finished:
                self._done(finished)

    def _done(self, finished: list[tuple[SlotJob, str | None]]) -> None:
        """Report the jobs (each with its fault, or None) and free their places, in one go: one
        lock and at most one wake-up a batch (each one a turn on the GIL the engine waits for)."""
        self._on_done(finished)
        for job, _ in finished:
            if job.header is not None:
                self._headers.put(job.header)
            if job.bounce is not None:
                self._bounces.put(job.bounce)
        with self._cond:
            for job, _ in finished:
                del self._issued[job.id]
            if self._queued["read"] or self._queued["write"]:  # the issuing thread has work again
                self._cond.notify_all()

    def _outcome(self, job: SlotJob, result: int) -> str | None:
        """None if the job succeeded, else the stats counter of its fault (verifies reads)."""
        if result < 0:
            return fault_of(-result)
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
