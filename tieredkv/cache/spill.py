"""The NVMe tier as the CPU tier uses it.

Operations:
- `spill_ahead()`: write the coldest cached CPU blocks to the NVMe store in the background, so
  that by the time the CPU tier evicts them they are already safe on disk (no step waits).
- `before_evict(cpu_block)`: the CPU tier is about to reuse a block: finish its write first
  (only if it is still in flight, which spill-ahead makes rare).
- `contains(hash)`, `start_read(...) -> job | None`, `poll() -> [(job, ok)]`: loads back.
"""

from __future__ import annotations

import itertools

import torch

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.tiers.nvme.store import NVMeStore

MAX_WRITES_IN_FLIGHT = 64


class NVMeSpill:
    """Spills cold CPU blocks to `store` and reads prefix blocks back into CPU blocks."""

    def __init__(self, store: NVMeStore, cpu_pool: BlockPool, cpu_data: torch.Tensor) -> None:
        self.store = store
        self.cpu_pool = cpu_pool
        self.cpu_data = cpu_data
        self.window = max(8, len(cpu_pool.blocks) // 4)  # LRU-front blocks kept on disk
        self._writes: dict[int, int] = {}  # cpu block id -> write job
        self._write_jobs: dict[int, tuple[int, int]] = {}  # write job -> (cpu block id, block hash)
        # cpu block id -> the hash of the content of it that is on disk: spill-ahead skips these
        # without calling into the store (it scans its window on every step)
        self._on_disk: dict[int, int] = {}
        self.spilled_blocks = 0
        self.eviction_waits = 0

    def spill_ahead(self) -> None:
        candidates = itertools.islice(self.cpu_pool.free_queue.values(), self.window)
        for block in candidates:
            if len(self._writes) >= MAX_WRITES_IN_FLIGHT:
                return
            if block.block_hash is None or block.block_id in self._writes:
                continue
            if self._on_disk.get(block.block_id) == block.block_hash:
                continue
            job = self.store.submit_write(
                block.block_hash, block.parent_hash, block.token_ids, self.cpu_data[block.block_id]
            )
            if job is not None:
                self._writes[block.block_id] = job
                self._write_jobs[job] = (block.block_id, block.block_hash)
            elif self.store.contains(block.block_hash):  # stored already (else: no free slot now)
                self._on_disk[block.block_id] = block.block_hash

    def before_evict(self, cpu_block: Block) -> None:
        job = self._writes.pop(cpu_block.block_id, None)
        if job is not None:
            self.eviction_waits += 1
            self._count_write(self._write_jobs.pop(job), self.store.wait([job])[job])

    def contains(self, block_hash: int) -> bool:
        return self.store.contains(block_hash)

    def start_read(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...], cpu_block: Block) -> int | None:
        """Read a stored block into `cpu_block` (held by the caller until the job is reported)."""
        return self.store.submit_read(block_hash, self.cpu_data[cpu_block.block_id], parent_hash, token_ids)

    def poll(self) -> list[tuple[int, bool]]:
        """Finished reads; finished writes are booked here."""
        reads = []
        for job, ok in self.store.poll():
            written = self._write_jobs.pop(job, None)
            if written is None:
                reads.append((job, ok))
            else:
                del self._writes[written[0]]
                self._count_write(written, ok)
        return reads

    def _count_write(self, written: tuple[int, int], ok: bool) -> None:
        if ok:
            self.spilled_blocks += 1
            block_id, block_hash = written
            self._on_disk[block_id] = block_hash

    def stats(self) -> dict[str, int | str]:
        store = self.store.stats()
        return {
            "nvme_spilled_blocks": self.spilled_blocks,
            "nvme_slots_used": store["slots_used"],
            "nvme_slots_total": store["slots_total"],
            "nvme_io_backend": store["backend"],
            "nvme_hits": store["hits"],
            "nvme_corrupt": store["corrupt"],
            "nvme_io_errors": store["io_errors"] + store["enospc"] + store["short_reads"] + store["short_writes"],
            "nvme_files_lost": store["files_lost"],
            "nvme_eviction_waits": self.eviction_waits,
        }

    def close(self) -> None:
        self.store.close()
