"""Block moves between the GPU tier and the CPU tier.

Operations:
- `demote(gpu_block)`: a cached GPU block is being evicted: keep its KV in the CPU tier
  (queued; `flush()` submits all queued demotions as one D2H job).
- `lookup(hash, parent, tokens)`: a demoted prefix block in the CPU tier.
- `copy_in(cpu_blocks, gpu_ids) -> job id`: promote or swap in (one H2D job); the CPU blocks
  stay reserved until the job has finished.
- `copy_out(gpu_ids) -> cpu blocks | None`: swap out (one D2H job).
- `retire()`: release what finished transfers held; book finished NVMe reads; spill ahead.
- `start_loads(request_id, refs)` / `loading(request_id)` / `release_loads(request_id)`: read
  a request's prefix blocks from NVMe into held CPU blocks before it is admitted.
"""

from __future__ import annotations

from collections.abc import Collection

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.spill import NVMeSpill
from tieredkv.tiers.backend import BlockRef, BlockStore
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.engine import TransferEngine, TransferError, TransferJob


class CPUOffload:
    """The CPU tier's bookkeeping (a `BlockPool` like the GPU tier's: owned blocks hold
    swapped-out sequences, cached unowned blocks demoted prefixes), the transfer engine, and
    optionally a slow tier (`store`, e.g. NVMe) below them."""

    def __init__(self, tier: CPUTier, transfers: TransferEngine, store: BlockStore | None = None) -> None:
        self.tier = tier
        self.pool = BlockPool(tier.num_blocks)
        self.transfers = transfers
        self.nvme = NVMeSpill(store, self.pool, tier.data) if store is not None else None
        self._demotions: list[tuple[int, Block]] = []
        self._held: dict[int, list[Block]] = {}
        self._loads: dict[str, list[Block]] = {}  # request -> CPU blocks read (or being read) for it
        self._reads: dict[int, tuple[str, Block, BlockRef]] = {}  # NVMe job -> what it fills
        self._reads_left: dict[str, int] = {}  # request -> its reads in flight
        self._orphans: set[int] = set()  # reads whose request left before they finished
        self.hit_blocks = 0
        self.demoted_blocks = 0
        self.nvme_loaded_blocks = 0
        self.nvme_failed_loads = 0

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def demote(self, gpu_block: Block) -> None:
        assert gpu_block.block_hash is not None, "only cached blocks are demoted"
        known = self.pool.cached_block(gpu_block.block_hash)
        if known is not None:
            if known.ref_count == 0:
                self.pool.refresh(known)
            return
        taken = self.pool.allocate(1)
        if taken is None:  # the CPU tier is full of swapped sequences: the prefix is dropped
            return
        cpu_block = taken[0]
        self.pool.cache(cpu_block, gpu_block.block_hash, gpu_block.parent_hash, gpu_block.token_ids)
        self._demotions.append((gpu_block.block_id, cpu_block))

    def flush(self) -> None:
        """Submit the queued demotions (before anything may overwrite their GPU blocks)."""
        if not self._demotions:
            return
        pending, self._demotions = self._demotions, []
        job = TransferJob("d2h", tuple(g for g, _ in pending), tuple(c.block_id for _, c in pending))
        try:
            job_id = self.transfers.submit(job)
        except TransferError:
            for _, cpu_block in pending:  # their content never arrived: forget them
                self.pool.uncache(cpu_block)
            self.pool.release(c for _, c in pending)
            return
        self.demoted_blocks += len(pending)
        self._held[job_id] = [c for _, c in pending]

    def lookup(self, block_hash: int, parent_hash: int, token_ids: list[int]) -> Block | None:
        return self.pool.lookup(block_hash, parent_hash, token_ids)

    def copy_in(self, cpu_blocks: list[Block], gpu_ids: list[int]) -> int:
        """H2D copy of `cpu_blocks` into `gpu_ids`; the caller's CPU references are taken
        over and dropped once the copy has finished. Returns the job id; raises TransferError."""
        self.flush()
        job = TransferJob("h2d", tuple(gpu_ids), tuple(b.block_id for b in cpu_blocks))
        try:
            job_id = self.transfers.submit(job)
        except TransferError:
            self.pool.release(cpu_blocks)
            raise
        self._held[job_id] = list(cpu_blocks)
        return job_id

    def copy_out(self, gpu_ids: list[int]) -> list[Block] | None:
        """D2H copy of `gpu_ids` into fresh CPU blocks (owned by the caller), or None when the
        CPU tier has no room or the copy cannot start."""
        cpu_blocks = self.pool.allocate(len(gpu_ids))
        if cpu_blocks is None:
            return None
        self.flush()
        try:
            self.transfers.submit(TransferJob("d2h", tuple(gpu_ids), tuple(b.block_id for b in cpu_blocks)))
        except TransferError:
            self.pool.release(cpu_blocks)
            return None
        return cpu_blocks

    def retire(self) -> None:
        for job_id in self.transfers.poll():
            self.pool.release(self._held.pop(job_id, []))
        if self.nvme is not None:
            for job, ok in self.nvme.poll():
                self._finish_read(job, ok)
            self.nvme.spill_ahead()

    # ------------------------------------------------------------------ NVMe loads

    def nvme_contains(self, block_hash: int) -> bool:
        return self.nvme is not None and self.nvme.contains(block_hash)

    def start_loads(self, request_id: str, refs: list[BlockRef]) -> int:
        """Read `refs` from NVMe into CPU blocks held for the request; how many reads started."""
        held = self._loads.setdefault(request_id, [])
        started = 0
        for ref in refs:
            taken = self.pool.allocate(1)
            if taken is None:
                break
            job = self.nvme.start_read(ref, taken[0])
            if job is None:  # evicted from the store since the lookup
                self.pool.release(taken)
                break
            held.append(taken[0])
            self._reads[job] = (request_id, taken[0], ref)
            started += 1
        self._reads_left[request_id] = self._reads_left.get(request_id, 0) + started
        return started

    @property
    def reads_in_flight(self) -> int:
        return len(self._reads)

    def loading(self, request_id: str) -> bool:
        return self._reads_left.get(request_id, 0) > 0

    def release_loads(self, request_id: str) -> None:
        """Drop the request's hold on its loaded blocks (they stay cached in the CPU tier)."""
        held = self._loads.pop(request_id, [])
        if not self.loading(request_id):  # the common case (called on every admission and free)
            self.pool.release(held)
            return
        in_flight = {id(block): job for job, (rid, block, _) in self._reads.items() if rid == request_id}
        for block in held:
            job = in_flight.get(id(block))
            if job is None:
                self.pool.release([block])
            else:  # its read still writes into it: release when the read is reported
                self._orphans.add(job)

    def _finish_read(self, job: int, ok: bool) -> None:
        request_id, block, ref = self._reads.pop(job)
        self._reads_left[request_id] -= 1
        if not self._reads_left[request_id]:
            del self._reads_left[request_id]
        if ok:
            self.pool.cache(block, ref.block_hash, ref.parent_hash, ref.token_ids)
            self.nvme_loaded_blocks += 1
        else:
            self.nvme_failed_loads += 1
        if job in self._orphans:
            self._orphans.discard(job)
            self.pool.release([block])

    def before_forward(self, later: Collection[int] = ()) -> None:
        self.flush()
        self.transfers.order_compute(later)

    def stats(self) -> dict[str, int | float]:
        return {
            "cpu_blocks_total": self.tier.num_blocks,
            "cpu_blocks_used": self.tier.num_blocks - self.pool.num_free,
            "cpu_blocks_cached": self.pool.num_cached,
            "cpu_hit_blocks": self.hit_blocks,
            "cpu_demoted_blocks": self.demoted_blocks,
            "bytes_d2h": self.transfers.bytes_moved["d2h"],
            "bytes_h2d": self.transfers.bytes_moved["h2d"],
            "transfer_failures": self.transfers.num_failures,
            "transfer_wait_s": self.transfers.compute_wait_s,
            **(self._nvme_stats() if self.nvme else {}),
        }

    def _nvme_stats(self) -> dict[str, int]:
        return {
            **self.nvme.stats(),
            "nvme_loaded_blocks": self.nvme_loaded_blocks,
            "nvme_failed_loads": self.nvme_failed_loads,
        }

    def drain(self) -> None:
        """Wait for every transfer and release what they held."""
        self.transfers.wait_all()
        self.retire()

    def close(self) -> None:
        self.drain()
        if self.nvme is not None:
            self.nvme.close()
        self.tier.close()
