"""NVMe tier: a persistent store of CPU blocks in the fixed-size slots of one preallocated file.

Two-phase API, one CPU block per job (a block is `block_bytes` contiguous bytes, e.g. `cpu_pool[i]`)::

    store = NVMeStore(path, capacity_bytes, block_bytes, fingerprint, block_size, backend="uring")
    ref = BlockRef(block_hash, parent_hash, token_ids)
    job = store.submit_write(ref, src)     # None: nothing started
    job = store.submit_read(ref, dst)      # None: not stored (a miss)
    jobs = store.submit_reads([(ref, dst), ...])  # up to the first miss; the disk gets them at once
    store.poll() -> [(job, ok), ...]       # jobs finished since the last poll, each reported once
    store.wait([job, ...]) -> {job: ok}    # blocks; `await store.wait_async(jobs)` under asyncio
    store.contains(block_hash); store.contains_run(hashes) -> leading ones stored; store.stats()
    store.record(hashes, num_hits_above)   # a request: the replacement policy learns from it
    store.take_lost() -> LostBlocks        # blocks discarded (failed read) since last asked, or all (file lost)
    store.sync() -> ok                     # every job done, file fsynced
    store.close()                          # or `with NVMeStore(...) as store:`

`path` is a directory holding the file `tieredkv-blocks.slots` (a missing path becomes such a
directory) or an existing store file. Opening refuses symbolic links to files, and files that
are neither empty nor a store; a store larger than the free space is refused before any is
taken, and a failed open removes the file and folders it created.

`src`/`dst` must stay alive and untouched until their job is reported. `ok` is False when the
I/O failed, came back short, or a read did not verify (header fields, header checksum, payload
xxh3); the block then is not stored (its slot is discarded), `dst` holds garbage, the caller
recomputes, and the cause is counted in `stats()` (the first of each kind is logged as a
warning). Submits never raise for I/O trouble: faults come back as failed jobs (ValueError only
for bad arguments).

Submits only queue the job: checksums, headers, copies and I/O happen on the store's threads,
reads before writes (slot_io.py). Writes take a free slot, else the slot of a block the
replacement policy gives up (`policy`: `adaptive`, `tinylfu` or `lru`, as the CPU tier's; see
slot_index.py): the least recently used stored block (reads, writes and re-submitted writes
count as uses), under `adaptive` and `tinylfu` a chain's tail before its head, and under
`tinylfu` (or `adaptive` while frequency wins) only if the new block was asked for more often
lately than the victim (else `write_declined`). The policy learns from the blocks offered
(every `submit_write`) and the requests `record` reports. Header and payload go out
in one vectored write, straight from the caller's memory when it is 4 KiB-aligned (see
`aligned_empty`), else through a bounce buffer. A crash mid-write can leave a torn slot; its
header's payload checksum then fails, so it is never served. Opening a store scans the slot
headers: blocks written under the same fingerprint and format version are found again, in the
order they were written; damaged slot headers, or a damaged superblock (the file is then
formatted anew), are logged once and counted (`scan_discarded`, `reformatted`). If the file is
deleted while open (its directory too), the next submit notices: all blocks are lost (reads
return None), `files_lost` is counted, the lost file is closed once no job uses it (so its space
returns), and the next job's thread makes a new file (and directory); if that fails (a full
disk), submits start nothing until a retry, after 1 s, then twice as long each time up to a
minute (logged once).
Layout: slot_format.py; I/O: slot_io.py; the file, its loss and remaking: file_keeper.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from tieredkv.replacement import ReplacementPolicy
from tieredkv.tiers.backend import BlockRef, BlockStore, LossLog, LostBlocks
from tieredkv.tiers.nvme.block_io import BlockIO, IOOp
from tieredkv.tiers.nvme.file_keeper import FileKeeper
from tieredkv.tiers.nvme.io_backends import IOBackend, make_backend
from tieredkv.tiers.nvme.slot_format import SlotGeometry, SlotHeader, check_block, check_ids, fingerprint_digest
from tieredkv.tiers.nvme.slot_index import Declined, SlotIndex
from tieredkv.tiers.nvme.slot_io import SlotIO, SlotJob

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 32  # I/Os in flight
# close() waits for the jobs in flight while one finishes at least this often; a disk that hangs
# longer is left with its jobs (their buffers, threads and file stay until the process ends)
CLOSE_STALL_S = 10.0

_COUNTERS = (
    "hits misses writes bytes_read bytes_written evictions write_rejected write_declined restored "
    "corrupt io_errors enospc short_reads short_writes files_lost scan_discarded reformatted "
    "internal_errors"
).split()


class NVMeStore(BlockStore):
    """Fixed-size slots of one file holding CPU blocks, verified on every read (module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: bytes | int,
        block_size: int,
        backend: IOBackend | BlockIO = "uring",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        policy: ReplacementPolicy = "adaptive",
    ) -> None:
        """`path`: the store file, or a directory to hold it; `fingerprint`: model config, dtype
        and block size (bytes, or the engine's int); `backend`: a name, or a BlockIO object
        (the fault-injection seam; the store closes it); `queue_depth`: I/Os in flight;
        `policy`: which block a full store gives up (module docstring)."""
        self.policy = policy
        self.geometry = SlotGeometry.for_block(capacity_bytes, block_bytes, block_size)
        self._fingerprint = fingerprint_digest(fingerprint)
        self._cond = threading.Condition()
        self._jobs: dict[int, SlotJob] = {}  # in flight
        self._done: dict[int, bool] = {}  # finished, not reported yet
        self._claimed: set[int] = set()  # ids some wait() is waiting for: poll() leaves them
        self._ids = itertools.count(1)
        self._counts: Counter[str] = Counter(dict.fromkeys(_COUNTERS, 0))
        self._said: set[str] = set()  # the kinds of fault logged as a warning already
        self._lost = LossLog()  # stored blocks discarded or lost with the file, for `take_lost`
        self._sequence, self._closed = 0, False
        # time with reads in flight: bytes read over it is the read bandwidth the engine gets
        self._reads_in_flight, self._read_busy_since, self._read_busy_s = 0, 0.0, 0.0
        files = None
        try:
            self._files = files = FileKeeper(path, self.geometry)
            self.path = files.path
            self.index = SlotIndex(self.geometry.num_slots, policy)
            if isinstance(backend, str):
                backend = make_backend(backend, queue_depth, os.path.dirname(self.path))
            self._load_index(backend)
        except BaseException:
            if not isinstance(backend, str):
                backend.close()
            if files is not None:
                files.discard()
            raise
        self._io = SlotIO(backend, self.geometry, self._fingerprint, queue_depth, self._finish, self._files.open_for)

    @property
    def num_slots(self) -> int:
        return self.geometry.num_slots

    @property
    def backend(self) -> BlockIO:
        return self._io.backend

    # ---------------------------------------------------------------- public API

    def contains(self, block_hash: int) -> bool:
        """True if the block is stored (its write finished) and not evicted or discarded."""
        with self._cond:
            return self.index.lookup(block_hash) is not None

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading `block_hashes` are stored (as `contains` answers each)."""
        with self._cond:
            for count, block_hash in enumerate(block_hashes):
                if self.index.lookup(block_hash) is None:
                    return count
            return len(block_hashes)

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        """Start storing the block in `src`; a job id, or None if no I/O was started.

        None: the block is stored or being written already (it becomes most recently used),
        every slot has I/O in flight (`write_rejected`), the policy keeps the victim instead
        (`write_declined`), the file is lost and cannot be made now, or the store is closed.
        Either way `src` is free at once.
        """
        block_hash, parent_hash = ref.block_hash, ref.parent_hash
        payload, tokens = self._check_args(ref, src, "src")
        self._check_file()
        with self._cond:
            self.index.offered(block_hash)
            if self._closed or self.index.known(block_hash):
                self.index.touch(block_hash)
                return None
            if self._files.waiting():
                return None
            reservation = self.index.reserve(block_hash, parent_hash)
            if reservation is None or isinstance(reservation, Declined):
                self._counts["write_rejected" if reservation is None else "write_declined"] += 1
                return None
            self._counts["evictions"] += reservation.evicted is not None
            self._sequence += 1
            job = self._new_job("write", block_hash, parent_hash, tokens, reservation.slot, payload)
            # the payload checksum is made on the I/O side
            job.write_header = SlotHeader(block_hash, parent_hash, tokens, payload.numel(), 0, self._sequence,
                                          self._fingerprint)
        self._io.start(job)
        return job.id

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        """Start loading the block into `dst`; a job id, or None if it is not stored (a miss)."""
        jobs = self.submit_reads([(ref, dst)])
        return jobs[0] if jobs else None

    def submit_reads(self, reads: Sequence[tuple[BlockRef, torch.Tensor]]) -> list[int]:
        """Start loading each block into its `dst`, in order, up to the first miss (counted):
        the job ids of the reads started. Those that can go at once (fewer than `queue_depth`
        in flight) reach the backend in one call; the rest queue for the issuing thread."""
        checked = [(ref, *self._check_args(ref, dst, "dst")) for ref, dst in reads]  # before any starts
        self._check_file()
        jobs = []
        with self._cond:
            for ref, payload, tokens in checked:
                slot = None if self._closed else self.index.pin(ref.block_hash, ref.parent_hash)
                if slot is None:
                    self._counts["misses"] += 1
                    break
                jobs.append(self._new_job("read", ref.block_hash, ref.parent_hash, tokens, slot, payload))
            if jobs and not self._reads_in_flight:
                self._read_busy_since = time.monotonic()
            self._reads_in_flight += len(jobs)
        if jobs:
            self._io.start_all(jobs)
        return [job.id for job in jobs]

    def record(self, block_hashes: Sequence[int], num_hits_above: int = 0) -> None:
        """A request for a prompt's full blocks, in order, of which the first `num_hits_above`
        were found in the tiers above and the rest asked of the store: the replacement policy
        counts it (under `lru`, nothing does)."""
        with self._cond:
            self.index.record(block_hashes, num_hits_above)

    def take_lost(self) -> LostBlocks:
        """The stored blocks lost since the last call: discarded after a failed read, or all of
        them (the file was lost: this looks, as a submit does). Not those its policy evicted:
        that was its choice."""
        self._check_file()
        with self._cond:
            return self._lost.take()

    def poll(self) -> list[tuple[int, bool]]:
        """(job id, ok) of every job finished since the last poll, in finishing order, except
        jobs a `wait` is waiting for (that wait reports them)."""
        with self._cond:
            done = [(i, ok) for i, ok in self._done.items() if i not in self._claimed]
            for i, _ in done:
                del self._done[i]
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
        """Block until the jobs finished; {job id: ok}. They are not reported by poll() again."""
        ids = list(job_ids)
        with self._cond:
            bad = [
                i
                for i in ids
                if i in self._claimed or (i not in self._jobs and i not in self._done)
            ]
            if bad:
                raise KeyError(
                    f"job ids {bad[:8]} are unknown, reported already, or waited for elsewhere"
                )
            self._claimed.update(ids)
            seen = 0  # ids[:seen] are done (claimed ids stay done), so each id is checked once

            def finished() -> bool:
                nonlocal seen
                while seen < len(ids) and ids[seen] in self._done:
                    seen += 1
                return seen == len(ids)

            try:
                if not self._cond.wait_for(finished, timeout):
                    raise TimeoutError(f"NVMe jobs {ids[seen:][:8]} not finished after {timeout} s")
                return {i: self._done.pop(i) for i in ids}
            finally:
                self._claimed.difference_update(ids)

    async def wait_async(
        self, job_ids: Iterable[int], timeout: float | None = None
    ) -> dict[int, bool]:
        """`wait` for asyncio code: the blocking part runs on the loop's default executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.wait, list(job_ids), timeout)

    def stats(self) -> dict[str, int | float | str | bool]:
        """Counters (hits, misses, bytes, evictions, each kind of fault), slot occupancy, and
        `read_busy_s`, the seconds with reads in flight (`bytes_read` over it is the read
        bandwidth the caller got, the disk shared as it was)."""
        with self._cond:
            out: dict[str, int | str | bool] = dict(self._counts)
            file = self._files.current
            busy = self._read_busy_s + (time.monotonic() - self._read_busy_since if self._reads_in_flight else 0.0)
            out.update(
                read_busy_s=busy,
                slots_total=self.num_slots,
                slots_used=self.index.num_stored,
                slots_free=self.index.num_free,
                in_flight=len(self._jobs),
                backend=self.backend.name,
                policy=self.policy,
                o_direct=file is not None and file.o_direct,
            )
        return out

    def sync(self) -> bool:
        """Wait until no job is in flight, then fsync the file; False if there is none (it was
        lost), or (counted) if that failed."""
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs)
            file = self._files.current
        if file is None:
            return False
        try:
            os.fsync(file.fd)
            return True
        except OSError as exc:
            logger.warning("NVMe store: fsync of %s failed: %s", self.path, exc)
            with self._cond:
                self._counts["io_errors"] += 1
            return False

    def close(self) -> None:
        """Finish in-flight jobs, stop the I/O threads, sync and close the file (idempotent).
        If no job finishes for `CLOSE_STALL_S` (a disk that hangs), it says so and returns,
        leaving the jobs still in flight their memory, threads and file: the kernel may still
        write into their buffers."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while left := len(self._jobs):
                if not self._cond.wait_for(lambda left=left: len(self._jobs) < left, CLOSE_STALL_S):
                    logger.warning("NVMe store: %d jobs still in flight after %.0f s with none finished (a disk "
                                   "that hangs?); closed without them", left, CLOSE_STALL_S)
                    return
        self._io.close()
        self._files.close()

    def __enter__(self) -> NVMeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- jobs

    def _check_args(self, ref: BlockRef, block: torch.Tensor, name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The block's bytes and token ids, checked (ValueError naming the bad argument)."""
        g = self.geometry
        payload = check_block(block, name, g.block_bytes, g.block_size, len(ref.token_ids))
        return payload, check_ids(ref.block_hash, ref.parent_hash, ref.token_ids)

    def _new_job(
        self,
        op: IOOp,
        block_hash: int,
        parent: int,
        tokens: tuple[int, ...],
        slot: int,
        payload: torch.Tensor,
    ) -> SlotJob:
        """Register a job (lock held), on the current file (none yet: made when it is issued)."""
        job = SlotJob(next(self._ids), op, block_hash, parent, tokens, slot, self._files.generation, payload)
        self._files.attach(job)
        self._jobs[job.id] = job
        return job

    def _finish(self, finished: Sequence[tuple[SlotJob, str | None]]) -> None:
        """Called by SlotIO with jobs done (and the fault of each, or None): update the index,
        the counters, the waiters."""
        with self._cond:
            for job, fault in finished:
                self._finish_one(job, fault)
            self._close_retired()
            self._cond.notify_all()

    def _finish_one(self, job: SlotJob, fault: str | None) -> None:
        current = job.generation == self._files.generation
        ok = fault is None and (current or job.op == "read")  # a write to a lost file is lost
        if current and job.op == "write":
            (self.index.commit if ok else self.index.abort)(job.block_hash)
        elif current:
            self.index.unpin(job.slot)
            if not ok:
                self.index.discard(job.block_hash)
                self._lost.lose(job.block_hash)
        if fault is not None:
            self._counts[fault] += 1
            self._say_fault(job, fault, current)
        elif ok:
            self._counts["hits" if job.op == "read" else "writes"] += 1
            self._counts["bytes_read" if job.op == "read" else "bytes_written"] += job.nbytes
        if job.op == "read":
            self._reads_in_flight -= 1
            if not self._reads_in_flight:
                self._read_busy_s += time.monotonic() - self._read_busy_since
        del self._jobs[job.id]
        self._done[job.id] = ok

    def _close_retired(self) -> None:
        """Close the lost files no job uses any more, so that their space returns (lock held)."""
        if self._files.has_retired:  # rare; walking every job in flight on each completion is not cheap
            self._files.close_unused({job.generation for job in self._jobs.values()})

    def _say_fault(self, job: SlotJob, fault: str, current: bool) -> None:
        """Log the first fault of each kind as a warning, the rest at debug level (lock held): the
        stats count them all. Jobs on a lost file (said when it was lost) and internal errors
        (logged where they happen) are not said again."""
        if fault in self._said or not current or self._files.current is None or fault == "internal_errors":
            logger.debug("NVMe %s of block %#x failed: %s", job.op, job.block_hash, fault)
            return
        self._said.add(fault)
        logger.warning("NVMe store %s: a block %s failed (%s); the block is recomputed, the store stays in use; "
                       "stats count every such fault, this log says it once", self.path, job.op, fault)

    # ---------------------------------------------------------------- the file

    def _check_file(self) -> None:
        """If the store file was deleted or replaced, forget its blocks; the next job makes a
        new file (FileKeeper.open_for, on the I/O side)."""
        if not self._files.vanished():
            return
        with self._cond:
            if not self._files.retire_vanished():
                return  # another thread noticed meanwhile
            self._counts["files_lost"] += 1
            self.index = SlotIndex(self.num_slots, self.policy)
            self._lost.lose_all()
            self._close_retired()

    def _load_index(self, backend: BlockIO) -> None:
        """Find the blocks an earlier store left in the file, or format it. Damage found here
        is logged once and counted (`reformatted`, `scan_discarded`)."""
        scan = self._files.load(backend, self._fingerprint)
        self.index.restore([(block_hash, slot) for _, block_hash, slot in scan.blocks])
        self._sequence = scan.blocks[-1][0] if scan.blocks else 0
        self._counts["restored"], self._counts["scan_discarded"] = len(scan.blocks), scan.damaged
        self._counts["reformatted"] = int(scan.reformatted)
        if scan.damaged:
            logger.warning(
                "NVMe store %s: %d slot headers are damaged and were discarded at start-up "
                "(%d blocks restored)", self.path, scan.damaged, len(scan.blocks),
            )
