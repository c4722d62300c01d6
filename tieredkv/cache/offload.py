"""Block moves between the GPU tier and the CPU tier.

Operations:
- `demote(gpu_block)`: a cached GPU block is being evicted: keep its KV in the CPU tier
  (queued; `flush()` submits all queued demotions as one D2H job, and only then are they found
  in the tier: a copy that fails to start leaves nobody holding them), unless the tier or the
  disk holds it already, or the admission policy prefers the block it would evict (a block
  read back from the tier below, waiting at the eviction end, is not weighed: it makes way for
  a newcomer asked for as often as the coldest block the tier keeps).
- `requested(hashes, num_gpu_hits)`: a request was admitted with these full prompt blocks,
  the first `num_gpu_hits` found on the GPU: counted for the admission policy (and the trace).
- `lookup(hash, parent, tokens)`: a demoted prefix block in the CPU tier.
- `copy_in(cpu_blocks, gpu_ids) -> job id`: promote or swap in (one H2D job); the CPU blocks
  stay reserved until the job has finished.
- `copy_out(gpu_ids) -> cpu blocks | None`: swap out (one D2H job), into blocks the lower
  tier gives up too (idle staging blocks, loads of requests not admitted yet) where the tier has
  no other room (`swap_room`); the job holds them as well until it has finished.
- `retire()`: release what finished transfers held; let the lower tier book its finished
  reads and writes and spill.
`lower` (`cache/lower_tier.py`), when there is a store below the CPU tier, owns the loads from
it and the spills to it, through CPU blocks of this tier.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.lower_tier import LowerTier
from tieredkv.cache.trace import BlockTrace, replay_all
from tieredkv.replacement import ReplacementPolicy, make_admission
from tieredkv.tiers.backend import BlockRef, BlockStore
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.engine import TransferEngine, TransferError, TransferJob


class CPUOffload:
    """The CPU tier's bookkeeping (a `BlockPool` like the GPU tier's: owned blocks hold
    swapped-out sequences, cached unowned blocks demoted prefixes), the transfer engine, and
    optionally the lower tier (`store`: NVMe, a remote server, or both) below them.

    Swapped-out sequences and demoted prefixes share the tier: a swap takes its blocks first
    (evicting prefixes; a swapped sequence comes back for certain, a prefix only maybe), and
    shares the prefix blocks the tier holds already. `trace`, when set, records what the tier
    was offered and asked for (`cache/trace.py`)."""

    def __init__(
        self, tier: CPUTier, transfers: TransferEngine, store: BlockStore | None = None,
        policy: ReplacementPolicy = "adaptive",
    ) -> None:
        self.tier = tier
        self.pool = BlockPool(tier.num_blocks)
        self.transfers = transfers
        self.admission = make_admission(policy, tier.num_blocks)
        self.lower = LowerTier(store, self.pool, tier.blocks, self.admission) if store is not None else None
        self.trace: BlockTrace | None = None
        self._demotions: list[tuple[int, Block]] = []
        self._unflushed: dict[int, BlockRef] = {}  # kept demotions not submitted yet: CPU block id -> its content
        self._staging: dict[int, BlockRef] = {}  # staging CPU block id -> the block it receives
        self._staged_unflushed: deque[int] = deque()  # indexes in _demotions of staged ones, oldest first
        self._held: dict[int, list[Block]] = {}
        self._copies_in: dict[int, int] = {}  # H2D job -> its blocks
        self.hit_blocks = 0
        self.demoted_blocks = 0
        self.rejected_blocks = 0  # demotions the admission policy turned down
        self.on_disk_blocks = 0  # turned-down demotions not staged: the disk holds the block
        self.shared_swap_blocks = 0  # swapped-out blocks that were cached in the tier already (not copied)

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
        if victim.block_hash is not None and not self._keeps(block_hash, victim):
            self.rejected_blocks += 1
            self._stage(gpu_block)
            return
        cpu_block = self.pool.allocate(1)[0]
        # findable once its copy is on its way (`flush`): nobody takes a block whose copy may fail
        self._unflushed[cpu_block.block_id] = BlockRef(block_hash, gpu_block.parent_hash, gpu_block.token_ids)
        self._demotions.append((gpu_block.block_id, cpu_block))

    def _keeps(self, block_hash: int, victim: Block) -> bool:
        """Whether the full tier keeps a newcomer in `victim`'s place. A block read back from the
        tier below for one request (its copy stays there) is not weighed: it makes way for a
        newcomer asked for as often as the coldest block the tier keeps (let in unweighed, every
        demotion took its place, and beside a store the tier kept 8x the demotions it kept
        alone on multi_turn_8b, for fewer hits)."""
        if not victim.evict_first:
            return self.admission.admits(block_hash, victim.block_hash)
        coldest = self.pool.next_kept_victim()
        return coldest is None or self.admission.admits_spare(block_hash, coldest.block_hash)

    def _stage(self, gpu_block: Block) -> None:
        """A block the CPU tier turned down goes to the lower tier through a staging block, if
        not there already. (A block the lower tier holds is still offered to the CPU tier:
        reading it back over PCIe is ~25x faster than from disk.)"""
        if self.lower is None:
            return
        if self.lower.contains(gpu_block.block_hash):
            self.on_disk_blocks += 1
            return
        staging, index = self.lower.stage(), len(self._demotions)
        if staging is None and self._staged_unflushed:
            # every staging block is taken by this step's demotions: the oldest of them makes way
            # (a chain is evicted tail first, so the newer one is nearer the head every hit needs)
            index = self._staged_unflushed.popleft()
            staging = self._demotions[index][1]
        if staging is None:
            return
        ref = BlockRef(gpu_block.block_hash, gpu_block.parent_hash, gpu_block.token_ids)
        if index == len(self._demotions):
            self._demotions.append((gpu_block.block_id, staging))
        else:
            self._demotions[index] = (gpu_block.block_id, staging)
        self._staging[staging.block_id] = ref
        self._staged_unflushed.append(index)

    def replay(self) -> dict[str, object] | None:
        """The `trace` replayed at the tier's size under every replay policy
        (`cache.trace.replay_all`); None if nothing was traced."""
        return None if self.trace is None else replay_all(self.trace, self.tier.num_blocks)

    def requested(self, block_hashes: list[int], num_gpu_hits: int) -> None:
        self.admission.record(block_hashes, num_gpu_hits)
        if self.trace is not None:
            self.trace.request(tuple(block_hashes[num_gpu_hits:]))

    def flush(self) -> None:
        """Submit the queued demotions (before anything may overwrite their GPU blocks)."""
        if not self._demotions:
            return
        pending, self._demotions = self._demotions, []
        self._staged_unflushed.clear()
        job = TransferJob("d2h", tuple(g for g, _ in pending), tuple(c.block_id for _, c in pending))
        try:
            job_id = self.transfers.submit(job)
        except TransferError:
            for _, cpu_block in pending:  # their content never arrives: free them (nobody found them)
                if self._staging.pop(cpu_block.block_id, None) is not None:
                    self.lower.unstage(cpu_block)
                else:
                    del self._unflushed[cpu_block.block_id]
                    self.pool.release([cpu_block])
            return
        for _, cpu_block in pending:  # kept, not passing through: findable now (a copy in waits for this job)
            ref = self._unflushed.pop(cpu_block.block_id, None)
            if ref is not None:
                self.pool.cache(cpu_block, *ref)
                self.demoted_blocks += 1
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

    @property
    def swap_room(self) -> int:
        """CPU blocks a swap-out may take: the free ones, and those the lower tier can give it
        (`LowerTier.make_room`: a swapped sequence comes back for certain, a spill or a load only maybe)."""
        return self.pool.num_free + (self.lower.swap_room if self.lower is not None else 0)

    def copy_out(self, gpu_ids: list[int]) -> list[Block] | None:
        """D2H copy of `gpu_ids` into fresh CPU blocks (owned by the caller), or None when the
        CPU tier has no room (`swap_room`) or the copy cannot start."""
        short = len(gpu_ids) - self.pool.num_free
        if short > 0 and self.lower is not None and self.lower.swap_room >= short:
            self.lower.make_room(short)
        cpu_blocks = self.pool.allocate(len(gpu_ids))
        if cpu_blocks is None:
            return None
        self.flush()
        try:
            job_id = self.transfers.submit(TransferJob("d2h", tuple(gpu_ids), tuple(b.block_id for b in cpu_blocks)))
        except TransferError:
            self.pool.release(cpu_blocks)
            return None
        for block in cpu_blocks:  # the copy holds them too: freed early (an abort), none is reused before it lands
            self.pool.touch(block)
        self._held[job_id] = list(cpu_blocks)
        return cpu_blocks

    def retire(self) -> int:
        """Book finished transfers and lower-tier I/O; how many finished."""
        finished = self.transfers.poll()
        for job_id in finished:
            self._copies_in.pop(job_id, None)
            self._release_held(job_id)
        return len(finished) + (self.lower.retire() if self.lower is not None else 0)

    def _release_held(self, job_id: int) -> None:
        """A transfer finished: release its CPU blocks; staged ones go on to the lower tier."""
        for block in self._held.pop(job_id, []):
            ref = self._staging.pop(block.block_id, None)
            if ref is None:
                self.pool.release([block])
            else:
                self.lower.write_staged(block, ref)

    @property
    def busy(self) -> bool:
        """Whether the lower tier's I/O, or transfers that finish without a step (not a
        tensor-parallel engine's: its ranks report them in a step's replies), are still in
        flight (`retire` books them)."""
        held = bool(self._held) and self.transfers.finishes_between_steps
        return held or (self.lower is not None and self.lower.busy)

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
            "transfer_jobs_d2h": self.transfers.jobs_started["d2h"],
            "transfer_jobs_h2d": self.transfers.jobs_started["h2d"],
            "transfer_submit_d2h_s": self.transfers.submit_s["d2h"],
            "transfer_submit_h2d_s": self.transfers.submit_s["h2d"],
            "transfer_failures": self.transfers.num_failures,
            "transfer_wait_s": self.transfers.compute_wait_s,
            **(self.lower.stats() if self.lower is not None else {}),
        }

    @property
    def _spill_blocks(self) -> int:
        """CPU blocks held on their way down (staging, writes in flight), not by requests."""
        return self.lower.held_blocks if self.lower is not None else 0

    def drain(self) -> None:
        """Wait for every transfer and release what they held."""
        self.transfers.wait_all()
        self.retire()

    def close(self) -> None:
        self.drain()
        if self.lower is not None:
            self.lower.close()
        self.tier.close()
