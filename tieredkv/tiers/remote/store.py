"""The remote tier: KV blocks in a Redis server that several engines share (a `BlockStore`).

    store = RemoteStore(url, block_bytes, fingerprint, block_size, budget_bytes=0)
    store.contains(block_hash)             # known here, else one EXISTS (misses remembered briefly)
    store.contains_run([h0, h1, ...]) -> n # the first n are stored: one pipeline of EXISTS at most
    job = store.submit_write(ref, src)     # None: stored already, over budget, or the tier is down
    job = store.submit_read(ref, dst)      # None: not stored (a miss)
    store.poll() -> [(job, ok), ...]; store.wait([job, ...]) -> {job: ok}
    store.take_lost() -> LostBlocks        # blocks found gone since last asked, or all (new epoch)
    store.stats(); store.measure_read_bandwidth(); store.close()

Writes queue to an asyncio loop on a thread of its own (`connection.py`), which sends them
through redis-py's asyncio client in pipelines of up to `pipeline_ops` commands, at most
`max_in_flight // 2` pipelines at once. Reads queue to `read_threads` reader threads, each with a
connection of its own, receiving values straight into their blocks (`reader.py`): a free thread
takes its share of the queue (up to `pipeline_ops`) as one pipeline, so reads submitted one by one
go out together, never wait behind a burst of writes, nor behind one thread's parsing. A write first
asks whether the key exists (another engine may have stored the block) and sends only the
blocks the server lacks. A read verifies the value (`value_format.py`) before copying it into
`dst`: a missing key (evicted, deleted, flushed) or a value that does not verify (truncated,
garbage) fails the job, is counted, and a bad value is deleted so that a later write replaces it.
The first bad value, and the first write the server refuses (out of memory), are logged as warnings.

Faults never raise: while the server is unreachable the tier is down (lookups miss, submits
return None, jobs in flight fail) and a health check brings it back (see `connection.py`).
`budget_bytes` bounds the bytes this engine stores: past it, it deletes the blocks it stored
and used least recently. What the engine knows of the server's blocks, the budget and the
counters (`stats()`) are kept in `ledger.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tieredkv.tiers.backend import BlockRef, BlockStore, LostBlocks
from tieredkv.tiers.nvme.slot_format import byte_view, check_block_bytes
from tieredkv.tiers.remote.connection import (
    ANY_ERROR,
    CONNECT_TIMEOUT_S,
    LINK_ERRORS,
    SOCKET_TIMEOUT_S,
    LoopThread,
    ServerLink,
    describe,
    redacted,
)
from tieredkv.tiers.remote.jobs import JobBook
from tieredkv.tiers.remote.ledger import Ledger
from tieredkv.tiers.remote.reader import DirectReads
from tieredkv.tiers.remote.value_format import ValueLayout, Verdict, block_key, epoch_key

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0  # one EXISTS from the engine's thread (a hung server stalls a step once)
CLOSE_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 30.0  # the start-up read bandwidth probe, each of its steps
PROBE_S = 0.5  # the probe reads for about this long at most (a slow server is measured quickly)
READ_THREADS = 4  # reader threads (and their connections) per server


@dataclass(eq=False)
class _Op:
    job: int
    kind: Literal["read", "write"]
    ref: BlockRef
    block: memoryview  # the caller's CPU block's bytes (`byte_view`: it keeps the block alive)


class RemoteStore(BlockStore):
    """A `BlockStore` on a Redis server (module docstring)."""

    def __init__(self, url: str, block_bytes: int, fingerprint: int, block_size: int, budget_bytes: int = 0,
                 max_in_flight: int = 8, pipeline_ops: int = 8, connect_timeout_s: float = 2.0,
                 read_threads: int = READ_THREADS, key_suffix: str = "") -> None:
        """`fingerprint`: the engine's model fingerprint (blocks of other models are never
        read); `budget_bytes`: the most this engine stores (0: no limit of its own);
        `read_threads`: reader connections (at most `max_in_flight`); `key_suffix`: appended to
        every block key (a tensor-parallel rank's share of a block, `:r<rank>of<world>`). An
        unreachable server is not an error: the store starts down and keeps trying."""
        self.layout = ValueLayout.for_block(block_bytes, block_size, fingerprint)
        if budget_bytes and budget_bytes < self.layout.value_bytes:
            raise ValueError(f"budget_bytes={budget_bytes} holds no block value of {self.layout.value_bytes} bytes")
        self.url, self.budget_bytes, self._fingerprint = url, budget_bytes, fingerprint
        self._key_suffix = key_suffix
        self.max_in_flight, self.pipeline_ops = max_in_flight, pipeline_ops
        self.jobs = JobBook()
        self.ledger = Ledger(self.layout, budget_bytes)
        self._lock = threading.Lock()  # guards the queues, `_draining` and `_closed`
        self._writes: list[_Op] = []  # for the loop thread's next dispatch
        self._reads: deque[_Op] = deque()  # for the reader threads, oldest first
        self._draining = 0  # reader threads taking from `_reads` (at most one per thread)
        self._closed = False
        self._loop = LoopThread("tieredkv-remote")
        try:
            self.link = ServerLink(url, epoch_key(fingerprint), self._loop, self._forget_all, max_in_flight + 2)
            self.reads = DirectReads(url, min(read_threads, max_in_flight), SOCKET_TIMEOUT_S, CONNECT_TIMEOUT_S)
        except ValueError:
            self._loop.close()
            raise
        self._loop.call(self._make_semaphores())
        self.link.start(connect_timeout_s)

    async def _make_semaphores(self) -> None:  # they belong to the loop: made on it
        self._write_slots = asyncio.Semaphore(max(1, self.max_in_flight // 2))
        self._tasks: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- the BlockStore API

    def contains(self, block_hash: int) -> bool:
        """True if the block is stored, as far as this engine knows or the server says now."""
        return self.contains_run([block_hash]) == 1

    def record(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        """Nothing: within `budget_bytes` this engine deletes its least recently used blocks, and
        the server evicts by its own `maxmemory-policy`."""

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading blocks are stored, as far as this engine knows or the server
        says now. The blocks it does not know, up to the first it knows to be absent, are asked
        about in one pipeline of EXISTS (one round trip); the answers are remembered (an absent
        block for `MISS_MEMORY_S`)."""
        if not self.link.up or self._closed:
            return 0
        stored = self.ledger.known_run(block_hashes)
        candidates = block_hashes[: len(stored)]  # up to the first block known to be absent
        ask = [h for h, known in zip(candidates, stored, strict=True) if not known]
        if ask:
            try:
                found = self._exists(ask)
            except ANY_ERROR as err:
                self._fault(err)
                return 0
            stored = [known or found[h] for h, known in zip(candidates, stored, strict=True)]
        return stored.index(False) if False in stored else len(stored)

    def _exists(self, block_hashes: list[int]) -> dict[int, bool]:
        """Ask the server which blocks it holds (one pipeline) and remember the answers."""
        replies = self._loop.call(self._pipeline([("exists", self._key(h)) for h in block_hashes]), LOOKUP_TIMEOUT_S)
        refused = [r for r in replies if isinstance(r, Exception)]
        if refused:
            raise refused[0]
        found = {h: r == 1 for h, r in zip(block_hashes, replies, strict=True)}
        self.ledger.learn(found)
        return found

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        """Start storing the block in `src`; None if nothing was started (module docstring)."""
        block = self._check_block(src, "src", ref)
        if self._closed or not self.link.up:
            return None
        doomed = self.ledger.admit_write(ref.block_hash)
        if doomed is None:
            return None
        if doomed:  # the least recently used blocks this engine stored, over its budget
            keys = [self._key(h) for h in doomed]
            self._loop.soon(lambda: self._spawn(self._delete(keys)))
        return self._enqueue("write", ref, block)

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        """Start loading the block into `dst`; None if it is not known to be stored."""
        block = self._check_block(dst, "dst", ref)
        if not self.contains(ref.block_hash):
            return None
        return self._enqueue("read", ref, block)

    def take_lost(self) -> LostBlocks:
        """The blocks known stored that went since the last call (`Ledger.take_lost`)."""
        return self.ledger.take_lost()

    def poll(self) -> list[tuple[int, bool]]:
        return self.jobs.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
        return self.jobs.wait(job_ids, timeout)

    def stats(self) -> dict[str, int | str | bool]:
        """`remote_*` counters: blocks read back and stored, faults (each one cost a recompute
        or a lost write), and what this engine stores on the server."""
        out: dict[str, int | float | str | bool] = dict(self.ledger.stats())
        out["remote_errors"] += self.link.faults
        out["remote_connected"] = self.link.up
        out["remote_in_flight"] = self.jobs.in_flight
        return out

    def read_busy_s(self) -> float:
        """Seconds with reads in flight so far (`remote_bytes_read` over it: the read bandwidth)."""
        return self.ledger.read_busy_s()

    def close(self) -> None:
        """Finish the jobs in flight (each ends by a socket timeout at the latest), then
        disconnect. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.jobs.drain()
        self.reads.close()
        self._loop.call(self._aclose())
        self._loop.close()

    async def _aclose(self) -> None:
        if self._tasks:  # deletions still on their way
            await asyncio.wait(list(self._tasks), timeout=CLOSE_TIMEOUT_S)
        await self.link.aclose()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def measure_read_bandwidth(self, num_bytes: int = 64 << 20, max_blocks: int = 256,
                               max_s: float = PROBE_S) -> float | None:
        """Bytes/s of block reads through this store: a probe block written once and read back
        as blocks are (pipelines on every reader thread, verified), `num_bytes` worth or at most
        `max_blocks` reads, stopping after about `max_s` seconds; None while the server is
        unreachable or if the probe failed."""
        if not self.link.up:
            return None
        probe = BlockRef(0, 0, ())
        src = torch.zeros(self.layout.block_bytes, dtype=torch.uint8)
        key = f"{self._key(0)}:probe:{os.urandom(8).hex()}"  # engines starting together probe apart
        count = min(max_blocks, max(self.reads.threads * self.pipeline_ops, num_bytes // self.layout.value_bytes))
        try:
            self._loop.call(self.link.client.set(key, self.layout.pack(probe, byte_view(src))), PROBE_TIMEOUT_S)
            reads, elapsed = self._probe_reads(key, probe, count, max_s)
            self._loop.call(self.link.client.unlink(key), PROBE_TIMEOUT_S)
        except ANY_ERROR as err:
            logger.warning("remote tier: measuring its read bandwidth failed (%s)", describe(err))
            return None
        return reads * self.layout.block_bytes / elapsed if reads else None

    def _probe_reads(self, key: str, probe: BlockRef, count: int, max_s: float) -> tuple[int, float]:
        """Read the probe key in waves, each twice the last (one read per reader first), until
        `count` reads or `max_s` seconds: (reads, seconds), (0, 0.0) if one did not verify."""
        threads = self.reads.threads
        dsts = [torch.empty(self.layout.block_bytes, dtype=torch.uint8) for _ in range(threads)]
        start, done, wave = time.perf_counter(), 0, threads
        while done < count and time.perf_counter() - start < max_s:
            n = min(wave, count - done)
            sizes = [n // threads + (i < n % threads) for i in range(threads)]
            futures = [self.reads.submit(self._probe_batch, key, probe, dst, size)
                       for dst, size in zip(dsts, sizes, strict=True) if size]
            if not all(f.result(PROBE_TIMEOUT_S) for f in futures):
                return 0, 0.0
            done, wave = done + n, 2 * wave
        return done, time.perf_counter() - start

    def _probe_batch(self, key: str, probe: BlockRef, dst: torch.Tensor, count: int) -> bool:
        """Read the probe `count` times into `dst`, in pipelines (reader thread); all verified?"""
        head, body = memoryview(bytearray(self.layout.header_bytes)), byte_view(dst)
        ok = True
        for i in range(0, count, self.pipeline_ops):
            n = min(self.pipeline_ops, count - i)
            for got in self.reads.get([key] * n, [head] * n, [body] * n):
                ok = ok and self.layout.verify(probe, got, head, body) == "ok"
        return ok

    # ---------------------------------------------------------------- submitting

    def _key(self, block_hash: int) -> str:
        return block_key(self._fingerprint, block_hash) + self._key_suffix

    def _check_block(self, block: torch.Tensor, name: str, ref: BlockRef) -> memoryview:
        check_block_bytes(block, name, self.layout.block_bytes, self.layout.block_size, len(ref.token_ids))
        return byte_view(block)

    def _enqueue(self, kind: Literal["read", "write"], ref: BlockRef, block: memoryview) -> int:
        """Queue a job. A read is taken by a reader thread as soon as one is free: one more
        starts draining the reads while fewer than all are at it; a write waits for the loop
        thread's next dispatch (woken once for all queued before it gets to them)."""
        job = self.jobs.start()
        op = _Op(job, kind, ref, block)
        if kind == "read":
            self.ledger.reading()
            with self._lock:
                self._reads.append(op)
                start = self._draining < self.reads.threads
                self._draining += start
            if start:
                self.reads.submit(self._drain_reads)
            return job
        with self._lock:
            self._writes.append(op)
            first = len(self._writes) == 1
        if first:
            self._loop.soon(self._dispatch)
        return job

    def _forget_all(self) -> None:
        """The server's blocks are not the ones known (a new epoch): forget them all."""
        self.ledger.clear()
        self.reads.reset()

    def _fault(self, err: BaseException) -> None:
        """Count a failed operation; a fault of the link takes the tier down (any thread)."""
        self.ledger.error()
        if isinstance(err, LINK_ERRORS):
            self.link.failed(err)  # at once: the next lookups must not wait for the server too

    # ---------------------------------------------------------------- the loop's side

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dispatch(self) -> None:
        """Send the queued writes, in pipelines (loop thread)."""
        with self._lock:
            writes, self._writes = self._writes, []
        for i in range(0, len(writes), self.pipeline_ops):
            self._spawn(self._run_writes(writes[i : i + self.pipeline_ops]))

    def _drain_reads(self) -> None:
        """Read queued blocks until none is left (reader thread). Each pipeline takes this
        thread's share of the queue (up to `pipeline_ops`): reads submitted one by one while
        the others are in flight go out together, not one round trip each."""
        while True:
            with self._lock:
                if not self._reads:
                    self._draining -= 1
                    return
                size = max(1, min(self.pipeline_ops, -(-len(self._reads) // self.reads.threads)))
                ops = [self._reads.popleft() for _ in range(min(size, len(self._reads)))]
            try:
                self._read_batch(ops)
            except BaseException:  # a bug: this thread stops draining, the others go on
                with self._lock:
                    self._draining -= 1
                raise

    async def _pipeline(self, commands: list[tuple]) -> list:
        """Run commands in one pipeline; a refused command comes back as its exception."""
        async with self.link.client.pipeline(transaction=False) as pipe:
            for name, *args in commands:
                getattr(pipe, name)(*args)
            return await pipe.execute(raise_on_error=False)

    def _read_batch(self, ops: list[_Op]) -> None:
        """Read blocks in one pipeline, each straight into its block, verified (reader thread)."""
        if not self.link.up:
            return self._fail(ops, ConnectionError("the tier is down"))
        heads = [memoryview(bytearray(self.layout.header_bytes)) for _ in ops]
        bodies = [op.block for op in ops]
        keys = [self._key(op.ref.block_hash) for op in ops]
        try:
            received = list(self.reads.get(keys, heads, bodies))
        except Exception as err:  # noqa: BLE001 (on a reader thread: failing its jobs is the way to tell)
            if not isinstance(err, ANY_ERROR):
                logger.exception("remote tier: a read failed unexpectedly")
            self.reads.reset()  # the other readers' connections may be as dead as this one's
            return self._fail(ops, err)
        verdicts = [self._book_read(op, self.layout.verify(op.ref, got, head, body))
                    for op, got, head, body in zip(ops, received, heads, bodies, strict=True)]
        damaged = [key for key, verdict in zip(keys, verdicts, strict=True) if verdict == "corrupt"]
        if damaged:  # before the jobs are reported, so that no write of theirs finds them stored
            self._delete_now(damaged)
        self.ledger.reads_done(len(ops))
        for op, verdict in zip(ops, verdicts, strict=True):
            self.jobs.finish(op.job, verdict == "ok")

    def _book_read(self, op: _Op, verdict: Verdict) -> Verdict:
        """Count the outcome of one read; say the first value that does not verify."""
        self.ledger.book_read(op.ref.block_hash, verdict)
        if verdict == "corrupt":
            self._say_once("corrupt", "a block value did not verify (truncated, damaged, or another block's); "
                           "it is deleted and the block recomputed")
        elif verdict == "missing":
            logger.debug("remote read of block %#x failed: %s", op.ref.block_hash, verdict)
        return verdict

    def _say_once(self, kind: str, what: str) -> None:
        """Log the first fault of each kind as a warning, later ones at debug level (stats count them all)."""
        if self.ledger.first_fault(kind):
            logger.warning("remote tier %s: %s; the tier stays in use; stats count every such fault (remote_%s), "
                           "this log says it once", redacted(self.url), what, kind)
        else:
            logger.debug("remote tier %s: %s", redacted(self.url), what)

    async def _run_writes(self, ops: list[_Op]) -> None:
        async with self._write_slots:
            if not self.link.up:
                return self._fail(ops, ConnectionError("the tier is down"))
            keys = [self._key(op.ref.block_hash) for op in ops]
            try:
                exists = await self._pipeline([("exists", key) for key in keys])
                todo = [(op, key) for op, key, found in zip(ops, keys, exists, strict=True) if found != 1]
                sets = [("set", key, self.layout.pack(op.ref, op.block)) for op, key in todo]
                results = await self._pipeline(sets) if sets else []
            except ANY_ERROR as err:
                return self._fail(ops, err)
        refused = [r for r in results if isinstance(r, Exception)]
        if refused:  # e.g. out of memory under `maxmemory-policy noeviction`
            self._say_once("errors", f"the server refused {len(refused)} writes ({describe(refused[0])})")
        stored = {id(op): not isinstance(r, Exception) for (op, _), r in zip(todo, results, strict=True)}
        for op in ops:
            sent = stored.get(id(op))  # None: the server had the block already
            self.ledger.wrote(op.ref.block_hash, sent)
            self.jobs.finish(op.job, sent is not False)

    def _fail(self, ops: list[_Op], err: BaseException) -> None:
        """Fail every job of a pipeline that did not run (loop or reader thread)."""
        if isinstance(err, LINK_ERRORS) and self.link.up:
            self.link.failed(err)
        writes = [op.ref.block_hash for op in ops if op.kind == "write"]
        self.ledger.failed(writes, len(ops) - len(writes))
        for op in ops:
            self.jobs.finish(op.job, False)

    async def _delete(self, keys: list[str]) -> None:
        try:
            await self.link.client.unlink(*keys)
        except ANY_ERROR as err:  # a leftover is found bad again by the next reader
            logger.debug("remote tier: deleting %d keys failed: %s", len(keys), describe(err))

    def _delete_now(self, keys: list[str]) -> None:
        """`_delete` on a reader thread, through its own connection."""
        try:
            self.reads.unlink(keys)
        except ANY_ERROR as err:
            logger.debug("remote tier: deleting %d keys failed: %s", len(keys), describe(err))
