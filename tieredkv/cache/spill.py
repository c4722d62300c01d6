"""The NVMe tier as the CPU tier uses it.

What is written: full prefix blocks worth reading back, i.e. asked for again since they were
first computed (the admission policy's counts, `cache/admission.py`), each once:
- `spill_ahead(reads_in_flight)`: write the coldest cached CPU blocks in the background, so
  that when the CPU tier evicts them they are safe on disk; a block being written is held
  (never evicted, so nothing ever waits for a write) and goes back to the front of the CPU
  tier's free queue, where it was taken, once it is on disk (evicting it then loses nothing);
- `stage() -> cpu block | None` / `write_staged(block, ref)`: a demotion the full CPU tier
  turned down but the disk should keep passes through one of a few staging blocks of the CPU
  tier on its way down;
- `persist()`: at shutdown, every cached CPU block, so that a restart finds them on disk.
Writes never crowd out reads: few are in flight, fewer while reads are.

What is read: `contains(hash)`, `start_read(...) -> job | None`, `poll() -> [(job, ok)]`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable

import torch

from tieredkv.cache.admission import AdmitAll, FrequencyAdmission
from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.tiers.backend import BlockRef, BlockStore

logger = logging.getLogger(__name__)

MAX_WRITES_IN_FLIGHT = 16  # keeps the disk busy at the store's queue depth
WRITES_BESIDE_READS = 2  # while reads are in flight, writes only trickle: reads come first
WORTH_WRITING = 2  # requests a block must have had: the one that computed it, and one more
STAGING_FRACTION = 16  # 1/16 of the CPU tier stages blocks on their way to disk (at most 256)


class NVMeSpill:
    """Spills worthwhile CPU blocks to `store` and reads prefix blocks back into CPU blocks."""

    def __init__(
        self, store: BlockStore, cpu_pool: BlockPool, cpu_data: torch.Tensor, admission: AdmitAll | FrequencyAdmission
    ) -> None:
        self.store = store
        self.cpu_pool = cpu_pool
        self.cpu_data = cpu_data
        self.admission = admission
        self.window = max(8, len(cpu_pool.blocks) // 4)  # the coldest cached blocks, kept on disk
        self._staging = cpu_pool.allocate(min(256, len(cpu_pool.blocks) // STAGING_FRACTION)) or []
        self._staged: list[tuple[Block, BlockRef]] = []  # landed in staging, waiting to be written
        self._writes: dict[int, tuple[Block, int, bool]] = {}  # write job -> (CPU block, hash, staged)
        # cpu block id -> the hash of the content of it that is on disk: spill-ahead skips these
        # without calling into the store (it scans its window on every step)
        self._on_disk: dict[int, int] = {}
        self.spilled_blocks = 0
        self.skipped_blocks = 0  # found on disk already: not written again
        self.staged_blocks = 0
        self.staging_full = 0  # demotions dropped: no staging block free

    def worth_writing(self, block_hash: int) -> bool:
        return not isinstance(self.admission, FrequencyAdmission) or self.admission.count(block_hash) >= WORTH_WRITING

    # ------------------------------------------------------------------ writes

    def stage(self) -> Block | None:
        """A staging block for a demotion on its way to disk, or None (counted) if none is free."""
        if not self._staging:
            self.staging_full += 1
            return None
        self.staged_blocks += 1
        return self._staging.pop()

    def write_staged(self, block: Block, ref: BlockRef) -> None:
        """The staging block holds the demoted block now: write it when the disk has room."""
        self._staged.append((block, ref))

    def unstage(self, block: Block) -> None:
        """The staging block's copy never arrived: it is free again."""
        self._staging.append(block)

    def spill_ahead(self, reads_in_flight: int) -> None:
        limit = WRITES_BESIDE_READS if reads_in_flight else MAX_WRITES_IN_FLIGHT
        self._spill(itertools.islice(self.cpu_pool.cold_blocks(), self.window), limit, closing=False)

    def persist(self) -> None:
        """At shutdown, when writes no longer compete with reads: write every cached CPU block the
        disk lacks, the coldest first (an LRU store keeps the hottest), so that a restart finds
        them there; wait until all writes are done."""
        start, before = time.monotonic(), self.spilled_blocks
        self._spill(self.cpu_pool.cold_blocks(), MAX_WRITES_IN_FLIGHT, closing=True)
        self._settle(list(self._writes))
        if self.spilled_blocks > before:
            logger.info("closing: wrote %d cached CPU blocks to the store in %.1f s", self.spilled_blocks - before,
                        time.monotonic() - start)

    def _spill(self, blocks: Iterable[Block], limit: int, closing: bool) -> None:
        """Write the staged demotions, then those of `blocks` worth it (all of them when
        `closing`), keeping at most `limit` writes in flight: beyond it, stop, or when `closing`
        wait for the oldest write."""

        def room() -> bool:
            if len(self._writes) >= limit and closing:
                self._settle(list(self._writes)[:1])
            return len(self._writes) < limit

        while self._staged and room():
            block, ref = self._staged.pop(0)
            self._write(block, ref, staged=True)
        for block in list(blocks):
            if self._on_disk.get(block.block_id) == block.block_hash:
                continue
            # asked before the store (a lookup may cost a round trip)
            if not closing and not self.worth_writing(block.block_hash):
                continue
            if not room():
                return
            if self.store.contains(block.block_hash):  # e.g. loaded from disk: left where it is
                self._on_disk[block.block_id] = block.block_hash
                self.skipped_blocks += 1
            else:
                self.cpu_pool.touch(block)  # held while written: never evicted, never waited for
                self._write(block, BlockRef(block.block_hash, block.parent_hash, block.token_ids), staged=False)

    def _settle(self, jobs: list[int]) -> None:
        for job, ok in self.store.wait(jobs).items():
            self._wrote_job(job, ok)

    def _write(self, block: Block, ref: BlockRef, staged: bool) -> None:
        if staged and self.store.contains(ref.block_hash):
            self.skipped_blocks += 1
            job = None
        else:
            job = self.store.submit_write(ref, self.cpu_data[block.block_id])
        if job is None:
            self._wrote(block, ref.block_hash, staged, self.store.contains(ref.block_hash))
        else:
            self._writes[job] = (block, ref.block_hash, staged)

    def _wrote(self, block: Block, block_hash: int, staged: bool, ok: bool) -> None:
        if staged:
            self._staging.append(block)
            return
        if ok:
            self._on_disk[block.block_id] = block_hash
        self.cpu_pool.release([block], evict_first=True)  # back to the front, where it was taken

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes) + len(self._staged)

    # ------------------------------------------------------------------ reads

    def contains(self, block_hash: int) -> bool:
        return self.store.contains(block_hash)

    def start_read(self, ref: BlockRef, cpu_block: Block) -> int | None:
        """Read a stored block into `cpu_block` (held by the caller until the job is reported)."""
        return self.store.submit_read(ref, self.cpu_data[cpu_block.block_id])

    def poll(self) -> list[tuple[int, bool]]:
        """Finished reads; finished writes are booked here."""
        reads = []
        for job, ok in self.store.poll():
            if job in self._writes:
                self._wrote_job(job, ok)
            else:
                reads.append((job, ok))
        return reads

    def _wrote_job(self, job: int, ok: bool) -> None:
        self.spilled_blocks += ok
        self._wrote(*self._writes.pop(job), ok)

    def read_counters(self) -> tuple[int, float]:
        """(bytes read, seconds with reads in flight), cumulative: the read bandwidth observed."""
        stats = self.store.stats()
        return stats["bytes_read"], stats["read_busy_s"]

    def stats(self) -> dict[str, int | str]:
        store = self.store.stats()
        return {
            "nvme_spilled_blocks": self.spilled_blocks,
            "nvme_write_skipped_blocks": self.skipped_blocks,
            "nvme_staged_blocks": self.staged_blocks,
            "nvme_staging_full": self.staging_full,
            "nvme_write_backlog": self.writes_in_flight,
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

    def close(self) -> None:
        self.store.close()
