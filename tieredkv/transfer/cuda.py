"""The CUDA transfer engine: gathers, DMAs and scatters on side streams, ordered by events.

A job is cut into chunks that cycle through a ring of staging slots in HBM:

    D2H   gather stream:  gather chunk i ─► slot i%N        (waits until slot i%N is free)
          copy stream:                       slot i%N ─DMA─► pinned CPU blocks (waits for gather i)
    H2D   copy stream:    pinned CPU blocks ─DMA─► slot i%N  (waits until slot i%N is free)
          scatter stream:                       slot i%N ─scatter─► GPU blocks (waits for DMA i)

so the gather (or scatter) of one chunk overlaps the DMA of another, and a job that fits in
the ring gathers all of its blocks at once: a forward pass that reuses its GPU blocks waits
only for the gathers, never for the DMAs. Jobs wait for each other only where they touch the
same GPU or CPU blocks. The gather and the scatter are compiled when the engine is made.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import torch

from tieredkv.kernels.block_copy import gather_blocks, scatter_blocks
from tieredkv.transfer.engine import TransferEngine, TransferJob, consecutive_runs

DEFAULT_STAGING_BYTES = 1 << 30
CHUNK_BYTES = 128 << 20
COPY_PROGRAMS: int | None = None  # CTAs of a gather/scatter (None: as many as the copy has pieces)


@dataclass
class _Pending:
    """A submitted job's blocks and events, until it is reported finished."""

    job: TransferJob
    gpu_ready: torch.cuda.Event  # its GPU blocks may be rewritten (D2H) / read (H2D)
    done: torch.cuda.Event  # its CPU blocks hold the data (D2H) / may be rewritten (H2D)


class CudaTransferEngine(TransferEngine):
    """Transfers overlap compute and each other."""

    def __init__(
        self, kv_cache: torch.Tensor, cpu_data: torch.Tensor, staging_bytes: int = DEFAULT_STAGING_BYTES,
        chunk_bytes: int = CHUNK_BYTES, copy_programs: int | None = COPY_PROGRAMS,
    ) -> None:
        super().__init__(kv_cache, cpu_data)
        self.copy_programs = copy_programs
        device = kv_cache.device
        self.chunk_blocks = max(1, chunk_bytes // self.block_bytes)
        num_slots = max(2, staging_bytes // (self.chunk_blocks * self.block_bytes))
        self.d2h = _Ring(num_slots, self.chunk_blocks, cpu_data.shape[1:], kv_cache.dtype, device)
        self.h2d = _Ring(num_slots, self.chunk_blocks, cpu_data.shape[1:], kv_cache.dtype, device)
        self._pending: dict[int, _Pending] = {}
        self._compute_waits: dict[int, torch.cuda.Event] = {}  # jobs no forward pass waited for yet
        self._stalls: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # around each compute wait
        self._compile_copies()

    def _compile_copies(self) -> None:
        """Launch the gather and the scatter once on a block id outside the cache, which they
        skip (nothing is read or written), so that Triton compiles them now. Compiled at their
        first use instead, they cost a fresh engine's first CPU hit or lower-tier load ~0.4 s
        (the scatter) and its first demotion ~0.1 s (the gather), on an H100."""
        nowhere = torch.full((1,), -1, dtype=torch.int64, device=self.kv_cache.device)
        gather_blocks(self.kv_cache, nowhere, self.d2h.slots[0][:1], self.copy_programs)
        scatter_blocks(self.h2d.slots[0][:1], self.kv_cache, nowhere, self.copy_programs)

    @property
    def streams(self) -> tuple[torch.cuda.Stream, ...]:
        """The side streams the transfers run on."""
        return self.d2h.first, self.d2h.second, self.h2d.first, self.h2d.second

    def _start(self, job_id: int, job: TransferJob) -> None:
        job = _in_cpu_order(job)
        caller_device = torch.cuda.current_device()
        compute = torch.cuda.current_stream(self.kv_cache.device)
        earlier = self._overlapping(job)
        try:
            if job.kind == "d2h":
                pending = self._d2h(job, compute, earlier)
                # a GPU block freed by this job may be rewritten by the next forward pass: that
                # pass must wait until the gathers have read it (the DMAs may still run on)
            else:
                pending = self._h2d(job, compute, earlier)
                # the next forward pass reads these blocks: it must wait until they have landed
        finally:
            # the side streams were made current in turn (`set_stream`: a job makes 238 Python
            # calls, ~510 with a `torch.cuda.stream` context each): the caller's stream and device come back
            torch.cuda.set_stream(compute)
            torch.cuda.set_device(caller_device)
        self._compute_waits[job_id] = pending.gpu_ready
        self._pending[job_id] = pending

    def _overlapping(self, job: TransferJob) -> list[_Pending]:
        gpu, cpu = set(job.gpu_block_ids), set(job.cpu_block_ids)
        return [
            p for p in self._pending.values()
            if not gpu.isdisjoint(p.job.gpu_block_ids) or not cpu.isdisjoint(p.job.cpu_block_ids)
        ]

    def _chunks(self, job: TransferJob) -> list[tuple[slice, tuple[int, ...]]]:
        n = self.chunk_blocks
        return [(slice(i, i + n), job.cpu_block_ids[i : i + n]) for i in range(0, len(job.gpu_block_ids), n)]

    def _gpu_ids(self, job: TransferJob, stream: torch.cuda.Stream) -> torch.Tensor:
        """The job's GPU block ids on the device, allocated on the stream that reads them, which
        is left current."""
        torch.cuda.set_stream(stream)
        host = torch.tensor(job.gpu_block_ids, dtype=torch.int64, pin_memory=True)
        return host.to(self.kv_cache.device, non_blocking=True)

    def _d2h(self, job: TransferJob, compute: torch.cuda.Stream, earlier: list[_Pending]) -> _Pending:
        ring = self.d2h
        # the blocks were written by forward passes queued on the compute stream: read after them
        ring.first.wait_stream(compute)
        for p in earlier:  # an earlier H2D may still fill these GPU blocks, or read these CPU blocks
            ring.first.wait_event(p.gpu_ready)
            ring.second.wait_event(p.done)
        gpu_ids = self._gpu_ids(job, ring.first)
        for rows, cpu_ids in self._chunks(job):
            slot = ring.acquire()
            torch.cuda.set_stream(ring.first)
            gather_blocks(self.kv_cache, gpu_ids[rows], slot[: len(cpu_ids)], self.copy_programs)
            ring.handoff()
            torch.cuda.set_stream(ring.second)
            for pos, first, length in consecutive_runs(cpu_ids):
                self.cpu_data[first : first + length].copy_(slot[pos : pos + length], non_blocking=True)
            ring.release()
        return _Pending(job, ring.first_done(), ring.second_done())

    def _h2d(self, job: TransferJob, compute: torch.cuda.Stream, earlier: list[_Pending]) -> _Pending:
        ring = self.h2d
        # the destination GPU blocks may still be read or written by queued forward passes
        ring.second.wait_stream(compute)
        for p in earlier:  # an earlier D2H may still read these GPU blocks or write these CPU blocks
            ring.second.wait_event(p.gpu_ready)
            ring.first.wait_event(p.done)
        gpu_ids = self._gpu_ids(job, ring.second)
        for rows, cpu_ids in self._chunks(job):
            slot = ring.acquire()
            torch.cuda.set_stream(ring.first)
            for pos, first, length in consecutive_runs(cpu_ids):
                slot[pos : pos + length].copy_(self.cpu_data[first : first + length], non_blocking=True)
            ring.handoff()
            torch.cuda.set_stream(ring.second)
            scatter_blocks(slot[: len(cpu_ids)], self.kv_cache, gpu_ids[rows], self.copy_programs)
            ring.release()
        done = ring.second_done()
        return _Pending(job, done, ring.first_done())

    def poll(self) -> list[int]:
        finished = [
            job_id for job_id, p in self._pending.items() if p.done.query() and p.gpu_ready.query()
        ]
        for job_id in finished:
            del self._pending[job_id]
        self._book_stalls()
        return finished

    def wait(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            if job_id in self._pending:
                self._pending[job_id].done.synchronize()
                self._pending[job_id].gpu_ready.synchronize()

    def order_compute(self, later: Collection[int] = ()) -> None:
        now = [job_id for job_id in self._compute_waits if job_id not in later]
        if not now:
            return
        compute = torch.cuda.current_stream(self.kv_cache.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        for job_id in now:
            compute.wait_event(self._compute_waits.pop(job_id))
        after.record(compute)
        self._stalls.append((before, after))

    def _book_stalls(self) -> None:
        """Add the compute waits that have finished to `compute_wait_s`: the stream's time
        between the two events around each. On the engine's thread, with the polls: `stats()`,
        read from any thread, then makes no CUDA call."""
        while self._stalls and self._stalls[0][1].query():
            before, after = self._stalls.popleft()
            self._wait_s += before.elapsed_time(after) / 1e3

    @property
    def compute_wait_s(self) -> float:
        """Seconds the compute stream stood waiting for transfers (the waits finished by the
        last poll; never blocks)."""
        return self._wait_s


def _in_cpu_order(job: TransferJob) -> TransferJob:
    """The same block pairs sorted by CPU block, so that neighbouring CPU blocks become one DMA
    in whatever order the job lists them (a prefix chain is demoted last block first)."""
    pairs = sorted(zip(job.cpu_block_ids, job.gpu_block_ids, strict=True))
    return TransferJob(job.kind, tuple(g for _, g in pairs), tuple(c for c, _ in pairs))


class _Ring:
    """Staging slots shared by a producer stream (`first`) and a consumer stream (`second`)."""

    def __init__(self, num_slots: int, chunk_blocks: int, block_shape: torch.Size, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots = torch.empty((num_slots, chunk_blocks, *block_shape), dtype=dtype, device=device)
        self.first = torch.cuda.Stream(device)
        self.second = torch.cuda.Stream(device)
        self._freed: list[torch.cuda.Event | None] = [None] * num_slots
        self._next = 0

    def acquire(self) -> torch.Tensor:
        """The next slot; the producer first waits until its last consumer is done with it."""
        index = self._next % len(self._freed)
        if self._freed[index] is not None:
            self.first.wait_event(self._freed[index])
        return self.slots[index]

    def handoff(self) -> None:
        """The consumer waits for what the producer just wrote into the slot."""
        ready = torch.cuda.Event()
        ready.record(self.first)
        self.second.wait_event(ready)

    def release(self) -> None:
        """The slot is free again once the consumer's work queued so far is done."""
        freed = torch.cuda.Event()
        freed.record(self.second)
        self._freed[self._next % len(self._freed)] = freed
        self._next += 1

    def first_done(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.first)
        return event

    def second_done(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.second)
        return event
