"""The lower tier's writes (`cache/lower_tier.py` owns them, and the reads beside them).

What is written: the full prefix blocks the CPU tier lets go, each once, and again if the store
loses it while the CPU tier still holds it (`store.take_lost()`, booked by `poll`: a read found it
damaged or gone, or the store's file or server lost them all; not a block the store's policy
evicted); which of them to keep is the store's own policy (asking the CPU tier's admission as
well wrote fewer and found fewer: BENCHMARKS.md, "The spill gate"):
- `spill_ahead(reads_in_flight)`: write the coldest cached CPU blocks in the background, so
  that when the CPU tier evicts them they are safe on disk; a block being written is pinned
  (never evicted meanwhile, so nothing ever waits for a write) and keeps its place in the CPU
  tier's order: being on disk does not make it go sooner (moved to the front once written,
  blocks gave up CPU hits worth more than the disk's copies on the conversation slices:
  BENCHMARKS.md, "Written blocks keep their place");
- `stage(reads_in_flight) -> cpu block | None` / `write_staged(block, ref, reads_in_flight)`:
  a demotion the full CPU tier turned down passes through one of a few staging blocks of the
  CPU tier on its way down; a copy that lands while the disk is behind waits in its staging
  block, not in the disk's queue. Waiting copies are written newest first (before any
  spill-ahead) once no read is in flight, and with every staging block taken the oldest
  waiting copy makes way for a new one: a chain is evicted tail first, so what is written
  first, and kept longest, is the head every later hit needs;
- `lend(n) -> int` / `lendable`: a swap-out the CPU tier has no other room for takes staging
  blocks not in use (a waiting copy in one is dropped, counted): a swapped sequence comes back
  for certain, a copy on its way to disk only maybe; they are taken back between steps, from
  blocks the CPU tier has free again (`spill_ahead`);
- `persist()`: at shutdown, every cached CPU block, so that a restart finds them on disk.

Writes never wait and never crowd out reads: while reads are in flight, or `max_writes` writes
are (`write_bound`: a long step's worth of the disk's time), the disk is behind and nothing is
submitted to it: a spill-ahead is dropped, a staged copy waits in its staging block (and is
dropped, counted, when a newer one takes that block); after repeated failed writes (a full or
lost disk) spilling pauses, for longer each time, and says so once. A write the store refuses
without starting it (its policy keeps the victim, every slot is busy, it is down) is no fault:
spill-ahead passes over that block for `REFUSED_RETRY_S`.
`poll() -> [(job, ok)]`: the store's finished reads (finished writes are booked here).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.tiers.backend import BlockRef, BlockStore

logger = logging.getLogger(__name__)

MIN_WRITES_IN_FLIGHT = 16  # the store's queue depth kept busy, whatever the block size
# Writes are topped up only between steps, and a step with a prefill of 8k tokens takes ~0.3 s:
# 512 MiB keep a 1.5-2 GB/s disk writing through it, where 16 writes of 2 MiB blocks left it
# idle most of the step and revisited documents never reached it whole (BENCHMARKS.md, "Documents
# revisited on the simulated clock, and writes through a step"). Writes in flight cost reads
# little: the store issues reads before the writes it queues, and the disk moves both side by side.
WRITE_BYTES_IN_FLIGHT = 512 << 20
STAGING_FRACTION = 16  # 1/16 of the CPU tier stages blocks on their way to disk
MAX_STAGING_BLOCKS = 256
FAILURES_BEFORE_PAUSE = 8  # failed writes in a row (one write window) before spilling pauses
PAUSE_FIRST_S, PAUSE_MAX_S = 1.0, 60.0  # the pause doubles while writes keep failing
REFUSED_RETRY_S = 1.0  # a block the store refused is offered again after this long
CLOSING_WAIT_S = 10.0  # at close, writes not finished this long are given up, and the rest with them
CLOSING_PROGRESS_S = 5.0  # a long write-down at close says how far it got this often


def write_bound(block_bytes: int) -> int:
    """Writes kept in flight for blocks of `block_bytes`: `WRITE_BYTES_IN_FLIGHT` of them, at
    least `MIN_WRITES_IN_FLIGHT`."""
    return max(MIN_WRITES_IN_FLIGHT, WRITE_BYTES_IN_FLIGHT // max(1, block_bytes))


def _nbytes(block) -> int:
    """A CPU block's bytes: one tensor, or (tensor parallel) one slice a rank."""
    return block.nbytes if hasattr(block, "nbytes") else sum(part.nbytes for part in block)


def staging_blocks(num_cpu_blocks: int) -> int:
    """CPU blocks reserved to stage demotions on their way to disk: 1/16 of the tier, at least
    one, at most 256; none in a one-block tier, whose block is needed to read blocks back."""
    return min(MAX_STAGING_BLOCKS, max(1, num_cpu_blocks // STAGING_FRACTION), num_cpu_blocks - 1)


class Spill:
    """Spills the CPU tier's blocks to `store` (the tier below the CPU tier)."""

    def __init__(self, store: BlockStore, cpu_pool: BlockPool, cpu_blocks: Sequence) -> None:
        self.store = store
        self.cpu_pool = cpu_pool
        self.cpu_blocks = cpu_blocks  # each CPU block's data, by block id
        self.window = max(8, len(cpu_pool.blocks) // 4)  # the coldest cached blocks, kept on disk
        self.num_staging = staging_blocks(len(cpu_pool.blocks))
        self.max_writes = write_bound(_nbytes(cpu_blocks[0]))
        self._staging = cpu_pool.allocate(self.num_staging) or []
        self._lent = 0  # staging blocks a swap-out took, to be taken back
        # staged copies that landed while the disk was behind, oldest first: written newest first,
        # before spill-ahead; the oldest gives its block up to a new copy when none is free
        self._waiting: deque[tuple[Block, BlockRef]] = deque()
        self._writes: dict[int, tuple[Block, int, bool]] = {}  # write job -> (CPU block, hash, staged)
        # cpu block id -> the hash of the content of it that is on disk: spill-ahead skips these
        # without calling into the store (it scans its window on every step); `poll` takes out
        # those the store lost
        self._on_disk: dict[int, int] = {}
        # cpu block id -> (hash, when) of content the store refused: spill-ahead passes over it a while
        self._refused: dict[int, tuple[int, float]] = {}
        self._failures = 0  # failed writes in a row
        self._pause_s, self._paused_until = PAUSE_FIRST_S, 0.0
        self.spilled_blocks = 0
        self.writes_finished = 0  # writes booked, failed ones too
        self.skipped_blocks = 0  # found on disk already: not written again
        self.staged_blocks = 0
        self.staging_full = 0  # demotions dropped before their copy: every staging block busy
        self.staged_waited = 0  # staged copies that waited in their staging block for the disk
        self.dropped = 0  # demotions bound for disk dropped: before their copy, or waiting copies replaced
        self.lent_blocks = 0  # staging blocks lent to swap-outs

    def behind(self, reads_in_flight: int) -> bool:
        """True when a write now would queue: reads are in flight (they come first), the write
        bound is reached, or spilling pauses after failed writes."""
        return reads_in_flight > 0 or len(self._writes) >= self.max_writes or self.paused

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

    # ------------------------------------------------------------------ writes

    def stage(self, reads_in_flight: int) -> Block | None:
        """A staging block for a demotion on its way to disk: a free one, else the one of the
        oldest copy waiting for the disk (dropped, counted); None (dropped, counted) when every
        staging block holds a copy in flight or a write. Waiting copies are written first, if
        the disk has room."""
        self._write_waiting(reads_in_flight)
        if self._staging:
            block = self._staging.pop()
        elif self._waiting:
            self.dropped += 1
            block = self._waiting.popleft()[0]
        else:
            self.dropped += 1
            self.staging_full += 1
            return None
        self.staged_blocks += 1
        return block

    def write_staged(self, block: Block, ref: BlockRef, reads_in_flight: int) -> None:
        """The staging block holds the demoted block now: write it, or, if the disk is behind,
        keep it there until it is not (it is never queued on the disk)."""
        if self.behind(reads_in_flight):
            self.staged_waited += 1
            self._waiting.append((block, ref))
            return
        self._write(block, ref, staged=True)

    def _write_waiting(self, reads_in_flight: int) -> None:
        """Write the staged copies that waited for the disk, newest first, while it has room."""
        while self._waiting and not self.behind(reads_in_flight):
            self._write(*self._waiting.pop(), staged=True)

    def unstage(self, block: Block) -> None:
        """The staging block's copy never arrived: it is free again."""
        self._staging.append(block)

    @property
    def lendable(self) -> int:
        """Staging blocks a swap-out may take: free, or holding a copy that waits for the disk."""
        return len(self._staging) + len(self._waiting)

    def lend(self, n: int) -> int:
        """Give up to `n` staging blocks back to the CPU tier for a swap-out, free ones first,
        then those of the oldest waiting copies (dropped, counted); how many."""
        blocks = []
        while len(blocks) < n and self._staging:
            blocks.append(self._staging.pop())
        while len(blocks) < n and self._waiting:
            self.dropped += 1
            blocks.append(self._waiting.popleft()[0])
        self.cpu_pool.release(blocks)
        self._lent += len(blocks)
        self.lent_blocks += len(blocks)
        return len(blocks)

    def _take_back(self) -> None:
        """Take back lent staging blocks from those the CPU tier has free."""
        blocks = self.cpu_pool.allocate(min(self._lent, self.cpu_pool.num_free)) if self._lent else None
        if blocks:
            self._staging.extend(blocks)
            self._lent -= len(blocks)

    def spill_ahead(self, reads_in_flight: int) -> None:
        self._take_back()
        self._write_waiting(reads_in_flight)
        if not self.behind(reads_in_flight):
            self._spill(itertools.islice(self.cpu_pool.cold_blocks(), self.window), closing=False)

    def persist(self) -> None:
        """At shutdown, when writes no longer compete with reads: write every cached CPU block the
        disk lacks, the coldest first (an LRU store keeps the hottest), so that a restart finds
        them there; wait until all writes are done. Writes the store has not finished after
        `CLOSING_WAIT_S` (a disk that hangs) end it: the rest is not written (said once)."""
        start, before = time.monotonic(), self.spilled_blocks
        try:
            while self._waiting:  # staged copies first: no CPU block holds them
                self._settle_one_if_full()
                self._write(*self._waiting.popleft(), staged=True)
            self._spill(self.cpu_pool.cold_blocks(), closing=True)
            self._settle(list(self._writes))
        except TimeoutError:
            logger.warning("closing: the tier below the CPU tier finished no write for %.0f s; the CPU tier's "
                           "blocks are not written down", CLOSING_WAIT_S)
        if self.spilled_blocks > before:
            logger.info("closing: wrote %d cached CPU blocks to the store in %.1f s", self.spilled_blocks - before,
                        time.monotonic() - start)

    def _spill(self, blocks: Iterable[Block], closing: bool) -> None:
        """Write those of `blocks` the store lacks, keeping at most `max_writes` writes
        in flight: beyond it (or once writes fail), stop, or when `closing` wait for the oldest
        write (and say how far it got every `CLOSING_PROGRESS_S`)."""
        now = said = time.monotonic()
        written = 0
        for block in list(blocks):
            if self._on_disk.get(block.block_id) == block.block_hash:
                continue
            if not closing and self._refused_lately(block, now):
                continue
            if not closing and self.behind(0):
                return
            self._settle_one_if_full()
            if self.store.contains(block.block_hash):  # e.g. loaded from disk: left where it is
                self._on_disk[block.block_id] = block.block_hash
                self.skipped_blocks += 1
            else:
                self.cpu_pool.pin(block)  # while written: never evicted, never waited for
                self._write(block, BlockRef(block.block_hash, block.parent_hash, block.token_ids), staged=False)
                written += 1
                if closing and time.monotonic() - said >= CLOSING_PROGRESS_S:
                    said = time.monotonic()
                    logger.info("closing: writing the CPU tier's cached blocks to the store, %d so far", written)

    def _refused_lately(self, block: Block, now: float) -> bool:
        """Whether the store refused this content of the block less than REFUSED_RETRY_S ago."""
        refused = self._refused.get(block.block_id)
        return refused is not None and refused[0] == block.block_hash and now - refused[1] < REFUSED_RETRY_S

    def _settle_one_if_full(self) -> None:
        """At `max_writes` writes, wait for the oldest (only where writes may wait: closing)."""
        if len(self._writes) >= self.max_writes:
            self._settle(list(self._writes)[:1])

    def _settle(self, jobs: list[int]) -> None:
        """Wait for these writes (only at close), at most `CLOSING_WAIT_S` (TimeoutError)."""
        for job, ok in self.store.wait(jobs, CLOSING_WAIT_S).items():
            self._wrote_job(job, ok)

    def _write(self, block: Block, ref: BlockRef, staged: bool) -> None:
        if staged and self.store.contains(ref.block_hash):
            self.skipped_blocks += 1
            self._release(block, ref.block_hash, staged, on_disk=True)
            return
        job = self.store.submit_write(ref, self.cpu_blocks[block.block_id])
        if job is not None:
            self._writes[job] = (block, ref.block_hash, staged)
            return
        # no write started: the block is stored (or being written) already, or the store refused it; no fault
        stored = self.store.contains(ref.block_hash)
        if not stored and not staged:
            self._refused[block.block_id] = (ref.block_hash, time.monotonic())
        self._release(block, ref.block_hash, staged, stored)

    def _release(self, block: Block, block_hash: int, staged: bool, on_disk: bool) -> None:
        """A write finished (or never started): its block is released either way."""
        if staged:
            self._staging.append(block)
            return
        if on_disk:
            self._on_disk[block.block_id] = block_hash
        self.cpu_pool.unpin(block)

    def _count_outcome(self, ok: bool) -> None:
        """Failed writes in a row pause spilling, twice as long each pause, until one succeeds."""
        if ok:
            if self._failures >= FAILURES_BEFORE_PAUSE:
                logger.info("writes to the tier below the CPU tier succeed again; spilling resumes")
            self._failures, self._pause_s = 0, PAUSE_FIRST_S
            return
        self._failures += 1
        if self._failures < FAILURES_BEFORE_PAUSE or self.paused:  # writes started before the pause
            return
        if self._failures == FAILURES_BEFORE_PAUSE:
            logger.warning("writes to the tier below the CPU tier keep failing (full or lost disk or server?); "
                           "spilling pauses and retries every %.0f to %.0f s (store stats count the faults)",
                           PAUSE_FIRST_S, PAUSE_MAX_S)
        self._paused_until = time.monotonic() + self._pause_s
        self._pause_s = min(2 * self._pause_s, PAUSE_MAX_S)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    @property
    def backlog(self) -> int:
        """Writes in flight, and staged copies waiting for the disk."""
        return len(self._writes) + len(self._waiting)

    @property
    def held_blocks(self) -> int:
        """CPU blocks the spill holds: the staging blocks, and cached blocks being written (pinned)."""
        return self.num_staging - self._lent + sum(not staged for _, _, staged in self._writes.values())

    def poll(self) -> list[tuple[int, bool]]:
        """Finished reads; finished writes are booked here, then the blocks the store lost are
        forgotten, so that those the CPU tier still holds are written again. The losses are
        taken before the writes: a block written and then lost is booked, then forgotten."""
        lost = self.store.take_lost()
        reads = []
        for job, ok in self.store.poll():
            if job in self._writes:
                self._wrote_job(job, ok)
            else:
                reads.append((job, ok))
        if lost.everything:
            self._on_disk.clear()
        elif lost.block_hashes:  # rare (a damaged or vanished block): one pass over the tier's blocks
            self._on_disk = {block_id: h for block_id, h in self._on_disk.items() if h not in lost.block_hashes}
        return reads

    def _wrote_job(self, job: int, ok: bool) -> None:
        self.writes_finished += 1
        self.spilled_blocks += ok
        self._count_outcome(ok)
        self._release(*self._writes.pop(job), ok)

    def stats(self) -> dict[str, int | str]:
        store = self.store.stats()
        return {
            "nvme_spilled_blocks": self.spilled_blocks,
            "nvme_write_skipped_blocks": self.skipped_blocks,
            "nvme_staged_blocks": self.staged_blocks,
            "nvme_staging_full": self.staging_full,
            "nvme_staged_waited": self.staged_waited,
            "nvme_spills_dropped": self.dropped,
            "nvme_staging_lent": self.lent_blocks,
            "nvme_write_backlog": self.backlog,
            "nvme_bytes_written": store["bytes_written"],
            "nvme_bytes_read": store["bytes_read"],
            "nvme_slots_total": store["slots_total"],
            "nvme_slots_used": store["slots_used"],
            "nvme_io_backend": store["backend"],
            "nvme_hits": store["hits"],
            "nvme_corrupt": store["corrupt"],
            "nvme_io_errors": store["io_errors"] + store["enospc"] + store["short_reads"] + store["short_writes"],
            "nvme_files_lost": store["files_lost"],
            "nvme_internal_errors": store["internal_errors"],  # bugs, not disk faults
            "nvme_restored": store["restored"],  # blocks found on disk at start-up
            "nvme_scan_discarded": store["scan_discarded"],  # damaged slot headers found then
            "nvme_reformatted": store["reformatted"],  # a damaged file formatted anew
        }
