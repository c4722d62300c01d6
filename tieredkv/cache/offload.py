"""Block moves between the GPU tier and the CPU tier.

Operations:
- `demote(gpu_block)`: a cached GPU block is being evicted: keep its KV in the CPU tier
  (queued; `flush()` submits all queued demotions as one D2H job), unless the tier or the
  disk holds it already, or the admission policy prefers the block it would evict.
- `requested(hashes, num_gpu_hits)`: a request was admitted with these full prompt blocks,
  the first `num_gpu_hits` found on the GPU: counted for the admission policy (and the trace).
- `lookup(hash, parent, tokens)`: a demoted prefix block in the CPU tier.
- `nvme_contains_run(hashes) -> n`: the first n blocks are in the tier below (one question).
- `copy_in(cpu_blocks, gpu_ids) -> job id`: promote or swap in (one H2D job); the CPU blocks
  stay reserved until the job has finished.
- `copy_out(gpu_ids) -> cpu blocks | None`: swap out (one D2H job).
- `retire()`: release what finished transfers held; book finished NVMe reads; write to NVMe.
- `start_loads(request_id, refs)` / `loading(request_id)` / `release_loads(request_id)`: read
  a request's prefix blocks from NVMe into held CPU blocks before it is admitted.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tieredkv.cache.admission import CPUPolicy, make_admission
from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.spill import NVMeSpill
from tieredkv.cache.trace import BlockTrace
from tieredkv.tiers.backend import BlockRef, BlockStore
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.engine import TransferEngine, TransferError, TransferJob


class CPUOffload:
    """The CPU tier's bookkeeping (a `BlockPool` like the GPU tier's: owned blocks hold
    swapped-out sequences, cached unowned blocks demoted prefixes), the transfer engine, and
    optionally a slow tier (`store`, e.g. NVMe) below them.

    Swapped-out sequences and demoted prefixes share the tier: a swap takes its blocks first
    (evicting prefixes; a swapped sequence comes back for certain, a prefix only maybe), and
    shares the prefix blocks the tier holds already. `trace`, when set, records what the tier
    was offered and asked for (`cache/trace.py`)."""

    def __init__(
        self, tier: CPUTier, transfers: TransferEngine, store: BlockStore | None = None, policy: CPUPolicy = "adaptive"
    ) -> None:
        self.tier = tier
        self.pool = BlockPool(tier.num_blocks)
        self.transfers = transfers
        self.admission = make_admission(policy, tier.num_blocks)
        self.nvme = NVMeSpill(store, self.pool, tier.data, self.admission) if store is not None else None
        self.trace: BlockTrace | None = None
        self._demotions: list[tuple[int, Block]] = []
        self._staging: dict[int, BlockRef] = {}  # staging CPU block id -> the block it receives
        self._held: dict[int, list[Block]] = {}
        self._copies_in: dict[int, int] = {}  # H2D job -> its blocks
        self._loads: dict[str, list[Block]] = {}  # request -> CPU blocks read (or being read) for it
        self._reads: dict[int, tuple[str, Block, BlockRef]] = {}  # NVMe job -> what it fills
        self._reads_left: dict[str, int] = {}  # request -> its reads in flight
        self._orphans: set[int] = set()  # reads whose request left before they finished
        self.hit_blocks = 0
        self.demoted_blocks = 0
        self.rejected_blocks = 0  # demotions the admission policy turned down
        self.on_disk_blocks = 0  # turned-down demotions not staged: the disk holds the block
        self.shared_swap_blocks = 0  # swapped-out blocks that were cached in the tier already (not copied)
        self.nvme_loaded_blocks = 0
        self.nvme_failed_loads = 0

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def demote(self, gpu_block: Block) -> None:
        block_hash = gpu_block.block_hash
        assert block_hash is not None, "only cached blocks are demoted"
        if self.trace is not None:
            self.trace.offer(block_hash)
        self.admission.offered(block_hash)
        known = self.pool.cached_block(block_hash)
        if known is not None:
            if known.ref_count == 0 and not known.evict_first:
                self.pool.refresh(known)
            return
        victim = self.pool.next_victim()
        if victim is None:  # the CPU tier is full of swapped sequences: the prefix is dropped
            return
        if victim.block_hash is not None and not self.admission.admits(block_hash, victim.block_hash):
            self.rejected_blocks += 1
            self._stage(gpu_block)
            return
        cpu_block = self.pool.allocate(1)[0]
        self.pool.cache(cpu_block, block_hash, gpu_block.parent_hash, gpu_block.token_ids)
        self._demotions.append((gpu_block.block_id, cpu_block))

    def _stage(self, gpu_block: Block) -> None:
        """A block the CPU tier turned down goes to disk through a staging block, if worth it
        and not there already. (A block the disk holds is still offered to the CPU tier: reading
        it back over PCIe is ~25x faster than from disk.)"""
        if self.nvme is None or not self.nvme.worth_writing(gpu_block.block_hash):
            return
        if self.nvme.contains(gpu_block.block_hash):
            self.on_disk_blocks += 1
            return
        staging = self.nvme.stage(len(self._reads))
        if staging is not None:
            ref = BlockRef(gpu_block.block_hash, gpu_block.parent_hash, gpu_block.token_ids)
            self._demotions.append((gpu_block.block_id, staging))
            self._staging[staging.block_id] = ref

    def requested(self, block_hashes: list[int], num_gpu_hits: int) -> None:
        self.admission.record(block_hashes, num_gpu_hits)
        if self.trace is not None:
            self.trace.request(tuple(block_hashes[num_gpu_hits:]))

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
                if self._staging.pop(cpu_block.block_id, None) is not None:
                    self.nvme.unstage(cpu_block)
                else:
                    self.pool.uncache(cpu_block)
                    self.pool.release([cpu_block])
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
        # released tail first once copied: a chain's head, which every prefix hit needs, stays longest
        self._held[job_id] = list(reversed(cpu_blocks))
        self._copies_in[job_id] = len(cpu_blocks)
        return job_id

    @property
    def h2d_queue_blocks(self) -> int:
        """Blocks of the copies in (promotions, swap-ins) not retired yet: the PCIe queue."""
        return sum(self._copies_in.values())

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
            self._copies_in.pop(job_id, None)
            self._release_held(job_id)
        if self.nvme is not None:
            for job, ok in self.nvme.poll():
                self._finish_read(job, ok)
            self.nvme.spill_ahead(len(self._reads))

    def _release_held(self, job_id: int) -> None:
        """A transfer finished: release its CPU blocks; staged ones go on to the disk."""
        for block in self._held.pop(job_id, []):
            ref = self._staging.pop(block.block_id, None)
            if ref is None:
                self.pool.release([block])
            else:
                self.nvme.write_staged(block, ref, len(self._reads))

    # ------------------------------------------------------------------ NVMe loads

    def nvme_contains_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading blocks the tier below holds (0 without one)."""
        return self.nvme.contains_run(block_hashes) if self.nvme is not None else 0

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
            # read back for one request, it does not displace what admission chose to keep (it
            # is on disk); it stays at the eviction end until admission keeps a demotion of it
            block.evict_first = self.admission.selective
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
            "cpu_blocks_used": self.tier.num_blocks - self.pool.num_free - self._spill_blocks,
            "cpu_blocks_staging": self._spill_blocks,
            "cpu_blocks_cached": self.pool.num_cached,
            "cpu_hit_blocks": self.hit_blocks,
            "cpu_demoted_blocks": self.demoted_blocks,
            "cpu_rejected_blocks": self.rejected_blocks,
            "cpu_demotions_on_disk": self.on_disk_blocks,
            "cpu_shared_swap_blocks": self.shared_swap_blocks,
            "bytes_d2h": self.transfers.bytes_moved["d2h"],
            "bytes_h2d": self.transfers.bytes_moved["h2d"],
            "transfer_failures": self.transfers.num_failures,
            "transfer_wait_s": self.transfers.compute_wait_s,
            **(self._nvme_stats() if self.nvme else {}),
        }

    @property
    def _spill_blocks(self) -> int:
        """CPU blocks held on their way to disk (staging, writes in flight), not by requests."""
        return self.nvme.held_blocks if self.nvme is not None else 0

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
            self.nvme.persist()
            self.nvme.close()
        self.tier.close()
