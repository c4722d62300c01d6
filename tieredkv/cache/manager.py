"""The KV cache manager: the scheduler's only door to blocks, in every tier. It reads
`Sequence`s and answers with typed results; it never writes them (the scheduler owns a
sequence's progress).

Operations:
- `match_prefix(seq) -> PrefixMatch`: the longest run of cached full blocks of the sequence,
  on the GPU, then in the CPU tier, then in the lower tier (disk, remote);
  `resident_tokens(seq)`: the tokens of that run on the GPU and in the CPU tier (no lower-tier
  lookup).
- `plan_loads(seq, split) -> LoadPlan | None`: once per stay in the waiting queue, start
  reading the later part of the sequence's lower-tier prefix blocks into the CPU tier (`split`,
  the policy, says how many of the earlier ones to compute instead); `read_ahead(seq, split,
  max_blocks)`: once they landed, on an idle lower tier, read more of what it was to compute.
- `lower_reads_in_flight()`: the lower tier's queue; `h2d_queue_blocks()`: the PCIe queue of
  copies in; `landed_loads()`: how long the loads that landed took.
- `land_loads(seq, wait_for_room) -> Landed`: once a running sequence's loads have all arrived,
  copy the blocks they brought into its next GPU blocks: the prefix tokens it jumps over (or
  that it waits for room for the rest of its prompt).
- `computable(seq, budget, prefix) -> int`: the one question about those loads: how many
  tokens the sequence may compute now (0: wait for its loads); `load_wait(seq) -> LoadWait`:
  whether a sequence found with nothing to compute before its loads land still waits for them;
  `late_reads(seq)`: the reads it waits for, and the queue ahead of them; `give_up_reads(seq)`:
  it computes those tokens instead.
- `allocate(seq, num_new_tokens, prefix) -> Allocation | None`: blocks for the next tokens
  (`None`, with nothing changed, when the GPU pool is short); CPU hits are promoted. A block
  the new tokens write into that the sequence shares (a fork) is copied first.
- `fork(parent, child)`: the child shares all of the parent's blocks, in every tier.
- `take_block_copies()`: the copy-on-write block copies to run before the next forward pass.
- `commit(seq)`: make newly computed full blocks findable by later requests.
- `swap_out(seq) -> bool` / `swap_in(seq, num_new_tokens) -> Allocation | KVLost | None`:
  move a preempted sequence's KV to the CPU tier and back. Full blocks are found by content on
  the way out and back, so a block that forked siblings share is moved once and stays shared.
- `free(seq)`: give the sequence's blocks back (cached ones stay findable).
- `block_table(seq)`: the block ids the model runner reads and writes.
- `retire()` / `before_forward()`: finish transfers; order the next forward pass after them.

What it composes: content keys and the prefix search (`cache/prefix.py`); each sequence's GPU
blocks and copy-on-write (`cache/block_tables.py`); the CPU blocks of swapped-out sequences
(`cache/swap.py`); the CPU tier and its transfers (`cache/offload.py`); the lower tier's
per-request load state (`cache/lower_tier.py`: this module asks it, and copies the blocks it
loaded onto the GPU).

A sequence whose KV is still being copied in by a job submitted this step (`landing` in the
results) computes from the next step on, so that this step's forward pass does not wait for
the copy: it overlaps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.block_tables import BlockTables
from tieredkv.cache.lower_tier import LandedLoad, LateReads, LoadWait
from tieredkv.cache.offload import CPUOffload
from tieredkv.cache.prefix import BlockKeys, PrefixMatch, find_prefix
from tieredkv.cache.swap import SwapSpace
from tieredkv.sequence import Sequence
from tieredkv.tiers.backend import BlockRef
from tieredkv.transfer.engine import TransferError


class Allocation(NamedTuple):
    """Blocks were found. `num_cached_tokens`: the prefix tokens a new sequence reuses from the
    cache (0 for others); `landing`: some of its KV is still being copied in (a promoted prefix,
    a swap-in), so the sequence computes from the next step on."""

    num_cached_tokens: int = 0
    landing: bool = False


EXTENDED = Allocation()  # a running sequence got the blocks for its next tokens
SWAPPED_IN = Allocation(landing=True)


class KVLost(NamedTuple):
    """A swapped-out sequence's KV did not come back: it must be recomputed."""

    reason: str


class Landed(NamedTuple):
    """Prefix tokens whose KV, loaded from the lower tier, a sequence jumps over, and whether
    its copy to the GPU is still landing (the sequence computes nothing until it has).
    `short`: the loads are all in, but the GPU pool has no room for the rest of its prompt; the
    loaded blocks wait in the CPU tier."""

    num_skipped_tokens: int = 0
    landing: bool = False
    short: bool = False


class LoadPlan(NamedTuple):
    """Prefix blocks found in the lower tier for a sequence, by what the policy chose for them."""

    num_compute: int
    num_load: int


# (blocks found in the lower tier, first token after the hits) -> how many of them to compute
SplitPolicy = Callable[[int, int], int]


class KVCacheManager:
    """Maps sequences to GPU blocks with prefix caching; optionally backed by a CPU tier."""

    def __init__(self, num_blocks: int, block_size: int, root_hash: int, offload: CPUOffload | None = None) -> None:
        self.block_size = block_size
        self.root_hash = root_hash
        self.keys = BlockKeys(block_size, root_hash)
        self.offload = offload
        self.lower = offload.lower if offload is not None else None  # the tiers below the CPU tier
        # The eviction chain, wired here and nowhere else:
        #   GPU pool evicts a cached block ──► offload.demote: unless a lower tier holds it or the
        #   CPU tier's admission turns it down, takes a CPU block (evicting one there) and queues
        #   a D2H copy; a block turned down that the disk should keep goes down through staging
        #   CPU pool evicts a cached block ──► nothing: blocks being written to disk are held,
        #   so no allocation ever waits for the disk
        self.pool = BlockPool(num_blocks, on_evict=offload.demote if offload else None)
        self.tables = BlockTables(self.pool)
        self.swap = SwapSpace(offload) if offload is not None else None
        # H2D copies submitted this step and the GPU blocks they fill
        self._landing_jobs: set[int] = set()
        self._landing_blocks: set[int] = set()
        self.prefix_hit_tokens = 0
        self.gpu_hit_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        """Block ids of the sequence, in token order (do not modify)."""
        return self.tables.ids(seq.seq_id)

    def cpu_free_blocks(self) -> int:
        """CPU blocks a swap-out may take (`CPUOffload.swap_room`)."""
        return self.offload.swap_room if self.offload else 0

    # ------------------------------------------------------------------ prefix hits

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The sequence's prefix found in each tier (`find_prefix`)."""
        return find_prefix(seq, self.keys, self.pool, self.offload)

    def resident_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of the sequence's prefix cached on the GPU and in the CPU tier (what
        `match_prefix` counts as usable now, without asking the lower tier)."""
        return find_prefix(seq, self.keys, self.pool, self.offload, lower=False).num_tokens(self.block_size)

    # ------------------------------------------------------------------ lower-tier loads

    def plan_loads(self, seq: Sequence, split: SplitPolicy) -> LoadPlan | None:
        """Start reading the later part of the sequence's lower-tier prefix blocks, once until it
        is freed; what was planned (None: planned before, or nothing in the lower tier)."""
        if self.lower is None or self.lower.planned(seq.seq_id):
            return None
        prefix = self.match_prefix(seq)
        first = prefix.num_tokens(self.block_size)
        compute = split(prefix.num_lower, first) if prefix.num_lower else 0
        start = len(prefix.gpu_blocks) + len(prefix.cpu_blocks)
        refs = tuple(self.keys.refs(seq, start + compute, start + prefix.num_lower))
        self.lower.plan(seq.seq_id, refs, first + compute * self.block_size, prefix.cpu_blocks)
        if not prefix.num_lower:
            return None
        return LoadPlan(compute, prefix.num_lower - compute)

    def read_ahead(self, seq: Sequence, split: SplitPolicy, max_blocks: int) -> int:
        """A waiting sequence whose loads landed, while the lower tier is idle: read the blocks
        before them too that `split` (at its queue now) no longer computes, the last first, up to
        `max_blocks` (a chunk the disk finishes before a newcomer's reads would wait long behind
        it); how many it brings."""
        lower = self.lower
        if lower is None or lower.busy or lower.arriving(seq.seq_id):
            return 0
        load_from = lower.ahead_of_loads(seq.seq_id)
        if load_from is None:
            return 0
        resident = find_prefix(seq, self.keys, self.pool, self.offload, lower=False)
        first = resident.num_tokens(self.block_size)
        start, stop = first // self.block_size, load_from // self.block_size
        if start >= stop:
            return 0
        compute = max(split(stop - start, first), stop - start - max_blocks)
        if compute >= stop - start or lower.held_run(self.keys.hit_candidates(seq), start + compute) < stop:
            return 0
        return lower.read_ahead(seq.seq_id, tuple(self.keys.refs(seq, start + compute, stop)), resident.cpu_blocks)

    def tokens_to_load(self, seq: Sequence, have: int | None = None) -> int:
        """Prompt tokens the sequence's lower-tier loads bring past the first `have` (default:
        those it has computed): it jumps over them once they land (0 with no loads planned)."""
        load_from = self.lower.load_from(seq.seq_id) if self.lower is not None else None
        if load_from is None:
            return 0
        end = load_from + self.lower.num_planned(seq.seq_id) * self.block_size
        return max(0, end - max(load_from, seq.num_computed_tokens if have is None else have))

    def lower_reads_in_flight(self) -> int:
        """Lower-tier block reads submitted and not finished: the tier's queue."""
        return self.lower.reads_in_flight if self.lower is not None else 0

    def landed_loads(self) -> list[LandedLoad]:
        """The sequences whose lower-tier loads landed since the last call, and how long they took."""
        return self.lower.landed_loads() if self.lower is not None else []

    def load_wait(self, seq: Sequence) -> LoadWait:
        """Whether a sequence found with nothing to compute before its loads land (`computable`
        said 0) still waits for them: ask before matching it again, which costs its prompt."""
        return self.lower.wait_state(seq.seq_id) if self.lower is not None else LoadWait.NONE

    def late_reads(self, seq: Sequence) -> LateReads | None:
        """The sequence's lower-tier reads in flight, if it waits for them (`computable` said 0)."""
        return self.lower.late(seq.seq_id) if self.lower is not None else None

    def give_up_reads(self, seq: Sequence) -> None:
        """The sequence computes the tokens its reads in flight would bring (they still land in
        the CPU tier); a running one jumps over those that landed first (`land_loads`)."""
        self.lower.give_up(seq.seq_id)

    def h2d_queue_blocks(self) -> int:
        """Blocks queued for copying CPU → GPU and not finished: the PCIe queue."""
        return self.offload.h2d_queue_blocks if self.offload is not None else 0

    def computable(self, seq: Sequence, budget: int, prefix: PrefixMatch | None = None) -> int:
        """Tokens the sequence may compute now, up to `budget`: a new sequence (with its
        `prefix`) from its hits on, a running one from its computed tokens on. Stops short of
        the prefix blocks being read from the lower tier and waits (0) while they are in flight
        (a running sequence jumps over them with `land_loads` once they are all in)."""
        start = seq.num_computed_tokens if prefix is None else prefix.num_tokens(self.block_size)
        n = min(len(seq.token_ids) - start, budget)
        load_from = self.lower.load_from(seq.seq_id) if self.lower is not None else None
        if load_from is None:
            return n
        if start < load_from:
            return min(n, load_from - start)
        if self.lower.arriving(seq.seq_id):
            self.lower.await_loads(seq.seq_id)
            return 0
        return n  # landed before admission: `allocate` promotes them as CPU hits

    def land_loads(self, seq: Sequence, wait_for_room: bool = False) -> Landed:
        """For a running sequence that reached its lower-tier prefix blocks and whose reads have
        all finished: copy the blocks that arrived intact from the CPU tier into its next GPU
        blocks, and takes the blocks for the rest of its prompt with them; the tokens it jumps
        over. Its load plan is done then. If the GPU pool has no room for the rest of its
        prompt, it waits for that room (`short`) while `wait_for_room` says blocks are coming
        back; else it copies its loaded blocks alone if they fit, or none (and computes them).
        Nothing happens before, or for a sequence without loads."""
        load_from = self.lower.load_from(seq.seq_id) if self.lower is not None else None
        if load_from is None or seq.num_computed_tokens < load_from or self.lower.arriving(seq.seq_id):
            return Landed()
        bs = self.block_size
        start = seq.num_computed_tokens // bs
        if seq.num_computed_tokens % bs:
            found = []
        else:
            found = self.keys.found_run(seq, self.keys.hit_candidates(seq), self.offload.pool, start)
        rest = self.blocks_needed(seq.num_prompt_tokens) - len(self.tables.blocks(seq.seq_id))
        if found and rest > self.pool.num_free:
            if wait_for_room:
                return Landed(short=True)
            rest = 0  # the blocks its loads brought alone, if they fit
        skipped = self._copy_loaded(seq, start, found, rest) if found else 0
        self.lower.landed(seq.seq_id)
        return Landed(skipped * bs, skipped > 0)

    def _copy_loaded(self, seq: Sequence, start: int, cpu_blocks: list[Block], reserve: int) -> int:
        """Copy `cpu_blocks` into the sequence's GPU blocks from `start` on, taking at least
        `reserve` new ones (the rest of its prompt); the blocks copied (0: the pool is short)."""
        table = self.tables.blocks(seq.seq_id)
        need = max(start + len(cpu_blocks) - len(table), reserve)
        if need > self.pool.num_free:
            return 0
        for block in cpu_blocks:
            self.offload.pool.touch(block)
        self.tables.extend(seq.seq_id, self.pool.allocate(max(need, 0)) or [])
        if not self._promote(cpu_blocks, table[start : start + len(cpu_blocks)]):
            return 0
        self._count_hit(seq, len(cpu_blocks) * self.block_size)
        self.tables.set_committed(seq.seq_id, start + len(cpu_blocks))
        return len(cpu_blocks)

    def _count_hit(self, seq: Sequence, num_tokens: int, num_gpu_blocks: int = 0) -> None:
        """Count prompt tokens reused from a cache (`num_gpu_blocks` of them found on the GPU):
        a client's prompt, not a recomputed sequence finding its own blocks again."""
        if not seq.recomputing:
            self.prefix_hit_tokens += num_tokens
            self.gpu_hit_blocks += num_gpu_blocks

    # ------------------------------------------------------------------ GPU blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> Allocation | None:
        """Blocks for `num_new_tokens` more tokens. A new sequence passes its `prefix`: the
        result says how many of its tokens the cache already holds. One with lower-tier loads
        planned gets them only while the pool has room for its whole prompt."""
        table = self.tables.blocks(seq.seq_id)
        if table is None:
            return self._allocate_new(seq, num_new_tokens, prefix or PrefixMatch())
        end = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        shared = [i for i in range(seq.num_computed_tokens // self.block_size, min(end, len(table)))
                  if table[i].ref_count > 1]
        fresh = self.pool.allocate(max(end - len(table), 0) + len(shared))
        if fresh is None:
            return None
        for i in shared:
            self.tables.copy_on_write(seq.seq_id, i, fresh.pop())
        self.tables.extend(seq.seq_id, fresh)
        return EXTENDED

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) GPU block copies that the next forward pass must find done:
        run them on the compute stream after `before_forward()`, before the forward pass."""
        return self.tables.take_copies()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child`, a copy of `parent`, shares every block `parent` holds (GPU blocks, or the CPU
        blocks of a swapped-out parent); a later write into a shared block copies it first. Loads
        in flight are not shared: a child that needs them plans its own."""
        self.tables.share(parent.seq_id, child.seq_id)
        if self.swap is not None:
            self.swap.share(parent.seq_id, child.seq_id)

    def _allocate_new(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> Allocation | None:
        reused, promoted = prefix.gpu_blocks, list(prefix.cpu_blocks)
        need = self.blocks_needed(prefix.num_tokens(self.block_size) + num_new_tokens) - len(reused)
        # reused blocks with no owner sit in the free queue: taking them shrinks it too
        idle = sum(1 for b in reused if b.ref_count == 0)
        room = need
        if self.lower is not None and self.lower.num_planned(seq.seq_id):
            # what its lower-tier loads bring is copied in at once when they land, and the rest of
            # its prompt follows: admitted with room for its first chunk alone, it would then push
            # out the sequences ranked after it (or compute what it read)
            room = max(need, self.blocks_needed(seq.num_prompt_tokens) - len(reused))
        if room + idle > self.pool.num_free:
            return None
        for block in promoted:  # hold them: demotions below could otherwise evict them
            self.offload.pool.touch(block)
        if self.lower is not None:
            self.lower.admitted(seq.seq_id)
        for block in reused:
            self.pool.touch(block)
        # reused blocks may be another request's promotion, still landing
        landing = any(b.block_id in self._landing_blocks for b in reused)
        fresh = self.pool.allocate(need)
        assert fresh is not None, "free count checked above"
        self.tables.start(seq.seq_id, [*reused, *fresh])
        if self.offload is not None:
            asked = self.keys.hit_candidates(seq)
            self.offload.requested(asked, len(reused))
            if self.lower is not None:
                self.lower.requested(asked, len(reused) + len(promoted))
        num_promoted = self._promote(promoted, fresh)
        num_hit_blocks = len(reused) + num_promoted
        self.tables.set_committed(seq.seq_id, num_hit_blocks)
        self._count_hit(seq, num_hit_blocks * self.block_size, len(reused))
        return Allocation(num_hit_blocks * self.block_size, landing or num_promoted > 0)

    def _promote(self, cpu_blocks: list[Block], gpu_blocks: list[Block]) -> int:
        """Copy CPU prefix blocks into the first of `gpu_blocks` and cache them there; how many
        arrived (0 if the copy failed: the tokens are recomputed instead)."""
        if not cpu_blocks:
            return 0
        targets = gpu_blocks[: len(cpu_blocks)]
        try:
            self._land(self.offload.copy_in(cpu_blocks, [b.block_id for b in targets]), targets)
        except TransferError:
            return 0  # the tokens are recomputed instead
        for src, dst in zip(cpu_blocks, targets, strict=True):
            self.pool.cache(dst, src.block_hash, src.parent_hash, src.token_ids)
        self.offload.hit_blocks += len(cpu_blocks)
        return len(cpu_blocks)

    def _land(self, job_id: int, gpu_blocks: list[Block]) -> None:
        self._landing_jobs.add(job_id)
        self._landing_blocks.update(b.block_id for b in gpu_blocks)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        done = self.tables.num_committed(seq.seq_id)
        if full <= done:
            return
        table = self.tables.blocks(seq.seq_id)
        for block, ref in zip(table[done:full], self.keys.refs(seq, done, full), strict=True):
            self.pool.cache(block, *ref)
        self.tables.set_committed(seq.seq_id, full)

    def swap_out(self, seq: Sequence) -> bool:
        """Copy the blocks holding the sequence's computed KV (the partial last one too) to the
        CPU tier (`SwapSpace.swap_out`) and free all of its GPU blocks. False (nothing changed)
        when there is nothing to keep, no CPU room, or the copy fails."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        if self.swap is None or keep == 0:
            return False
        refs = list(self.keys.refs(seq, 0, seq.num_computed_tokens // self.block_size))
        if not self.swap.swap_out(seq.seq_id, self.block_table(seq)[:keep], refs):
            return False
        self.tables.release(seq.seq_id)
        return True

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> Allocation | KVLost | None:
        """GPU blocks for a swapped sequence plus `num_new_tokens`, its KV copied back; None
        (nothing changed) when the GPU pool is short; KVLost when the copy cannot start (the
        sequence holds nothing any more and must be recomputed). A full block found on the GPU
        (still cached, or a sibling's swapped in before) is shared instead of copied back; the
        full blocks copied are made findable at once (they are landing)."""
        num_swapped = self.swap.num_blocks(seq.seq_id)
        num_full = seq.num_computed_tokens // self.block_size
        num_blocks = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        if num_blocks - self._owned_elsewhere(seq, num_full) > self.pool.num_free:
            return None  # short whatever is found: a sequence waiting to come back costs no keys a step
        refs = list(self.keys.refs(seq, 0, num_full))
        assert num_blocks >= num_swapped, "swap_out keeps only the blocks of computed tokens"
        table: list[Block | None] = [self.pool.lookup(*ref) for ref in refs]
        table += [None] * (num_blocks - len(table))
        need = table.count(None)
        idle = sum(1 for block in table if block is not None and block.ref_count == 0)
        if need + idle > self.pool.num_free:
            return None
        for block in table:  # taken before allocating: allocation evicts unowned blocks
            if block is not None:
                self.pool.touch(block)
        fresh = iter(self.pool.allocate(need) or [])
        to_copy = [i for i, block in enumerate(table[:num_swapped]) if block is None]
        table = [block if block is not None else next(fresh) for block in table]
        self.tables.start(seq.seq_id, table)
        self.tables.set_committed(seq.seq_id, len(refs))
        return self._copy_back(seq, refs, {i: table[i] for i in to_copy})

    def _owned_elsewhere(self, seq: Sequence, num_full: int) -> int:
        """How many of the sequence's first `num_full` blocks are cached on the GPU under their
        hash and owned by another sequence: at least as many as it could share (the hash is
        not verified), so the blocks it needs from the free pool are no fewer than the rest."""
        found = map(self.pool.cached_block, self.keys.hashes(seq)[:num_full])
        return sum(1 for block in found if block is not None and block.ref_count > 0)

    def _copy_back(self, seq: Sequence, refs: list[BlockRef], targets: dict[int, Block]) -> Allocation | KVLost:
        """Copy a swapped sequence's CPU blocks into their new GPU `targets` (by index in its
        table) and cache the full ones."""
        try:
            job_id = self.swap.copy_back(seq.seq_id, targets)
        except TransferError as err:
            self.free(seq)
            return KVLost(str(err))
        if job_id is not None:
            self._land(job_id, list(targets.values()))
        for i, block in targets.items():
            if i < len(refs):
                self.pool.cache(block, *refs[i])
        return SWAPPED_IN

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks in every tier and forget its load plan."""
        self.keys.forget(seq)
        self.tables.release(seq.seq_id)
        if self.swap is not None:
            self.swap.release(seq.seq_id)
        if self.lower is not None:
            self.lower.forget(seq.seq_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody owns, on the GPU and in the CPU tier (the lower tier
        keeps its blocks); returns how many were dropped."""
        if self.offload is None:
            return self.pool.drop_unowned()
        self.offload.drain()  # finished transfers still hold blocks until retired
        return self.pool.drop_unowned() + self.offload.pool.drop_unowned()

    def retire(self) -> int:
        """Before a step's schedule (the engine calls it while the GPU runs the step before):
        release what finished transfers held; the copies-in of the steps before are no longer
        landing (the next forward pass waits for them). How many transfers and lower-tier jobs
        finished."""
        self._landing_jobs.clear()
        self._landing_blocks.clear()
        return self.offload.retire() if self.offload else 0

    def tend(self) -> int | None:
        """Between requests (no step runs): book finished transfers and tier I/O, so that copies
        waiting for the disk are written and cold blocks spilled while it is free. None once no
        tier work is in flight; else how many jobs finished (ask again a little later)."""
        if not self.offload:
            return None
        finished = self.retire()
        return finished if self.offload.busy else None

    def before_forward(self) -> None:
        """Submit queued demotions and order the next forward pass after pending transfers
        (all but this step's copies-in: no sequence of this pass reads them)."""
        if self.offload:
            self.offload.before_forward(self._landing_jobs)

    def stats(self) -> dict[str, int | float]:
        stats = {
            "gpu_blocks_total": self.num_blocks,
            "gpu_blocks_used": self.num_blocks - self.pool.num_free,
            "gpu_blocks_cached": self.pool.num_cached,
            "gpu_blocks_free": self.pool.num_free,
            "gpu_evictions": self.pool.num_evictions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "gpu_hit_blocks": self.gpu_hit_blocks,
            "cow_block_copies": self.tables.cow_copies,
        }
        if self.offload:
            stats.update(self.offload.stats())
        return stats

    def close(self) -> None:
        if self.offload:
            self.offload.close()
