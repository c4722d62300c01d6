"""The KV cache manager: the scheduler's only door to blocks, in every tier. It reads
`Sequence`s and answers with typed results; it never writes them (the scheduler owns a
sequence's progress).

Operations:
- `match_prefix(seq) -> PrefixMatch`: the longest run of cached full blocks of the sequence,
  on the GPU, then in the CPU tier, then in the lower tier (disk, remote).
- `plan_loads(seq, split) -> LoadPlan | None`: once per stay in the waiting queue, start
  reading the later part of the sequence's lower-tier prefix blocks into the CPU tier (`split`,
  the policy, says how many of the earlier ones to compute instead).
- `lower_reads_in_flight()`: the lower tier's queue; `h2d_queue_blocks()`: the PCIe queue of
  copies in; `landed_loads()`: how long the loads that landed took.
- `land_loads(seq) -> Landed`: once a running sequence's loads have all arrived, copy the
  blocks they brought into its next GPU blocks: the prefix tokens it jumps over.
- `computable(seq, budget, prefix) -> int`: the one question about those loads: how many
  tokens the sequence may compute now (0: wait for its loads); `load_wait(seq) -> LoadWait`:
  whether a sequence found with nothing to compute before its loads land still waits for them.
The lower tier's per-request load state is `cache/lower_tier.py`'s (`LowerTier`); this module
asks it, and copies the blocks it loaded onto the GPU.
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

A sequence whose KV is still being copied in by a job submitted this step (`landing` in the
results) computes from the next step on, so that this step's forward pass does not wait for
the copy: it overlaps it.

Copy-on-write: forked sequences share blocks by reference count. Only a shared block that is
not full can be written (full blocks are never rewritten); the first sibling to write into it
gets a copy, and the last one writes in place:

    parent [b0 b1 b2*]      fork       a [b0 b1 b2*]  b [b0 b1 b2*]   (b2: 5 of 16 slots, ref 2)
    a computes token 5:  a [b0 b1 b7]  b [b0 b1 b2]   (b7 = copy of b2, then slot 5 written)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.cache.lower_tier import LandedLoad, LoadWait
from tieredkv.cache.offload import CPUOffload
from tieredkv.sequence import Sequence
from tieredkv.tiers.backend import BlockRef
from tieredkv.transfer.engine import TransferError


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks holding the first tokens of a sequence: GPU blocks, then CPU blocks,
    then blocks in the lower tier (usable once loaded into the CPU tier)."""

    gpu_blocks: tuple[Block, ...] = ()
    cpu_blocks: tuple[Block, ...] = ()
    lower_refs: tuple[BlockRef, ...] = ()

    def num_tokens(self, block_size: int) -> int:
        """Tokens usable now (GPU and CPU hits)."""
        return (len(self.gpu_blocks) + len(self.cpu_blocks)) * block_size


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
    its copy to the GPU is still landing (the sequence computes nothing until it has)."""

    num_skipped_tokens: int = 0
    landing: bool = False


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
        self.offload = offload
        self.lower = offload.lower if offload is not None else None  # the tiers below the CPU tier
        # The eviction chain, wired here and nowhere else:
        #   GPU pool evicts a cached block ──► offload.demote: unless a lower tier holds it or the
        #   CPU tier's admission turns it down, takes a CPU block (evicting one there) and queues
        #   a D2H copy; a block turned down that the disk should keep goes down through staging
        #   CPU pool evicts a cached block ──► nothing: blocks being written to disk are held,
        #   so no allocation ever waits for the disk
        self.pool = BlockPool(num_blocks, on_evict=offload.demote if offload else None)
        self._tables: dict[str, list[Block]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}
        self._swapped: dict[str, list[Block]] = {}
        # H2D copies submitted this step and the GPU blocks they fill
        self._landing_jobs: set[int] = set()
        self._landing_blocks: set[int] = set()
        self._copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) this step
        self.prefix_hit_tokens = 0
        self.gpu_hit_blocks = 0
        self.cow_copies = 0

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        """Block ids of the sequence, in token order (do not modify)."""
        return self._block_ids.get(seq.seq_id, [])

    def cpu_free_blocks(self) -> int:
        return self.offload.num_free if self.offload else 0

    # ------------------------------------------------------------------ prefix hits

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The sequence's prefix found in each tier, in order: GPU blocks, then CPU blocks, then
        blocks in the lower tier. Costs the blocks found, not the prompt (a waiting request is matched
        again at each step it cannot be admitted)."""
        refs = self._full_blocks(seq)
        gpu, miss = _run_of(refs, self.pool.lookup)
        if self.offload is None or miss is None:
            return PrefixMatch(tuple(gpu))
        cpu, miss = _run_of(itertools.chain([miss], refs), self.offload.lookup)
        if miss is None or self.lower is None:
            return PrefixMatch(tuple(gpu), tuple(cpu))
        # the store verifies parent and tokens when it reads the block
        start = len(gpu) + len(cpu)
        stop = self.lower.held_run(self._hit_candidates(seq), start)
        return PrefixMatch(tuple(gpu), tuple(cpu), tuple(self._block_refs(seq, start, stop)))

    def _hit_candidates(self, seq: Sequence) -> list[int]:
        """The hashes of the sequence's full blocks that a prefix hit may cover."""
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.root_hash)
        return hashes[: (seq.num_tokens - 1) // self.block_size]

    def _full_blocks(self, seq: Sequence, start: int = 0) -> Iterator[BlockRef]:
        """The sequence's full blocks from block `start` on that a prefix hit may cover: at
        least one token must be computed to get logits, so a full hit stops one block short."""
        return self._block_refs(seq, start, (seq.num_tokens - 1) // self.block_size)

    def _block_refs(self, seq: Sequence, start: int, stop: int) -> Iterator[BlockRef]:
        """Content keys of the sequence's full blocks `start` to `stop - 1`."""
        bs = self.block_size
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, bs, self.root_hash)
        for i in range(start, stop):
            parent = hashes[i - 1] if i else self.root_hash
            yield BlockRef(hashes[i], parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))

    # ------------------------------------------------------------------ lower-tier loads

    def plan_loads(self, seq: Sequence, split: SplitPolicy) -> LoadPlan | None:
        """Start reading the later part of the sequence's lower-tier prefix blocks, once until it
        is freed; what was planned (None: planned before, or nothing in the lower tier)."""
        if self.lower is None or self.lower.planned(seq.seq_id):
            return None
        prefix = self.match_prefix(seq)
        first = prefix.num_tokens(self.block_size)
        compute = split(len(prefix.lower_refs), first) if prefix.lower_refs else 0
        self.lower.plan(seq.seq_id, prefix.lower_refs[compute:], first + compute * self.block_size)
        if not prefix.lower_refs:
            return None
        return LoadPlan(compute, len(prefix.lower_refs) - compute)

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

    def land_loads(self, seq: Sequence) -> Landed:
        """For a running sequence that reached its lower-tier prefix blocks and whose reads have
        all finished: copy the blocks that arrived intact from the CPU tier into its next GPU
        blocks (none if the GPU pool is short); the tokens it jumps over. Its load plan is done
        then. Nothing happens before, or for a sequence without loads."""
        load_from = self.lower.load_from(seq.seq_id) if self.lower is not None else None
        if load_from is None or seq.num_computed_tokens < load_from or self.lower.arriving(seq.seq_id):
            return Landed()
        bs = self.block_size
        start = seq.num_computed_tokens // bs
        if seq.num_computed_tokens % bs:
            found = []
        else:
            found, _ = _run_of(self._full_blocks(seq, start), self.offload.lookup)
        skipped = self._copy_loaded(seq, start, found) if found else 0
        self.lower.landed(seq.seq_id)
        return Landed(skipped * bs, skipped > 0)

    def _copy_loaded(self, seq: Sequence, start: int, cpu_blocks: list[Block]) -> int:
        table = self._tables[seq.seq_id]
        need = start + len(cpu_blocks) - len(table)
        if need > self.pool.num_free:
            return 0
        for block in cpu_blocks:
            self.offload.pool.touch(block)
        self._extend(seq.seq_id, self.pool.allocate(max(need, 0)) or [])
        if not self._promote(cpu_blocks, table[start : start + len(cpu_blocks)]):
            return 0
        self._count_hit(seq, len(cpu_blocks) * self.block_size)
        self._num_committed[seq.seq_id] = start + len(cpu_blocks)
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
        result says how many of its tokens the cache already holds."""
        table = self._tables.get(seq.seq_id)
        if table is None:
            return self._allocate_new(seq, num_new_tokens, prefix or PrefixMatch())
        end = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        shared = [i for i in range(seq.num_computed_tokens // self.block_size, min(end, len(table)))
                  if table[i].ref_count > 1]
        fresh = self.pool.allocate(max(end - len(table), 0) + len(shared))
        if fresh is None:
            return None
        for i in shared:
            self._copy_on_write(seq.seq_id, i, fresh.pop())
        self._extend(seq.seq_id, fresh)
        return EXTENDED

    def _copy_on_write(self, seq_id: str, index: int, copy: Block) -> None:
        """Give the sequence `copy` in place of its shared block `index`; the copy is made
        before the next forward pass writes into it."""
        table = self._tables[seq_id]
        shared, table[index] = table[index], copy
        self._block_ids[seq_id][index] = copy.block_id
        self.pool.release([shared])  # its other owners keep it
        self._copies.append((shared.block_id, copy.block_id))
        self.cow_copies += 1

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) GPU block copies that the next forward pass must find done:
        run them on the compute stream after `before_forward()`, before the forward pass."""
        copies, self._copies = self._copies, []
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child`, a copy of `parent`, shares every block `parent` holds (GPU blocks, or the CPU
        blocks of a swapped-out parent); a later write into a shared block copies it first. Loads
        in flight are not shared: a child that needs them plans its own."""
        table = self._tables.get(parent.seq_id)
        if table is not None:
            for block in table:
                self.pool.touch(block)
            self._tables[child.seq_id] = list(table)
            self._block_ids[child.seq_id] = list(self._block_ids[parent.seq_id])
            self._num_committed[child.seq_id] = self._num_committed[parent.seq_id]
        swapped = self._swapped.get(parent.seq_id)
        if swapped is not None:
            for block in swapped:
                self.offload.pool.touch(block)
            self._swapped[child.seq_id] = list(swapped)

    def _allocate_new(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> Allocation | None:
        reused, promoted = prefix.gpu_blocks, list(prefix.cpu_blocks)
        need = self.blocks_needed(prefix.num_tokens(self.block_size) + num_new_tokens) - len(reused)
        # reused blocks with no owner sit in the free queue: taking them shrinks it too
        idle = sum(1 for b in reused if b.ref_count == 0)
        if need + idle > self.pool.num_free:
            return None
        for block in promoted:  # hold them: demotions below could otherwise evict them
            self.offload.pool.touch(block)
        if self.lower is not None:
            self.lower.release(seq.seq_id)
        for block in reused:
            self.pool.touch(block)
        # reused blocks may be another request's promotion, still landing
        landing = any(b.block_id in self._landing_blocks for b in reused)
        fresh = self.pool.allocate(need)
        assert fresh is not None, "free count checked above"
        self._tables[seq.seq_id], self._block_ids[seq.seq_id] = [], []
        self._extend(seq.seq_id, [*reused, *fresh])
        if self.offload is not None:
            asked = self._hit_candidates(seq)
            self.offload.requested(asked, len(reused))
            if self.lower is not None:
                self.lower.requested(asked, len(reused) + len(promoted))
        num_promoted = self._promote(promoted, fresh)
        num_hit_blocks = len(reused) + num_promoted
        self._num_committed[seq.seq_id] = num_hit_blocks
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

    def _extend(self, seq_id: str, blocks: list[Block]) -> None:
        self._tables[seq_id].extend(blocks)
        self._block_ids[seq_id].extend(b.block_id for b in blocks)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        done = self._num_committed[seq.seq_id]
        if full <= done:
            return
        table = self._tables[seq.seq_id]
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.root_hash)
        for i in range(done, full):
            parent = hashes[i - 1] if i else self.root_hash
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.pool.cache(table[i], hashes[i], parent, tokens)
        self._num_committed[seq.seq_id] = full

    def swap_out(self, seq: Sequence) -> bool:
        """Copy the blocks holding the sequence's computed KV (the partial last one too) to the
        CPU tier and free all of its GPU blocks. A full block the CPU tier holds already (a
        sibling's, a demoted prefix) is shared instead of copied, and the full blocks copied are
        made findable there. False (nothing changed) when there is nothing to keep, no CPU room,
        or the copy fails."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        if self.offload is None or keep == 0:
            return False
        refs = list(self._block_refs(seq, 0, seq.num_computed_tokens // self.block_size))
        found = [self.offload.lookup(*ref) for ref in refs] + [None] * (keep - len(refs))
        shared = [block for block in found if block is not None]
        for block in shared:  # held first: the copy below may evict unowned CPU blocks
            self.offload.pool.touch(block)
        to_copy = [i for i, block in enumerate(found) if block is None]
        copied = self.offload.copy_out([self.block_table(seq)[i] for i in to_copy]) if to_copy else []
        if copied is None:
            self.offload.pool.release(shared)
            return False
        for i, block in zip(to_copy, copied, strict=True):
            found[i] = block
            if i < len(refs):
                self.offload.pool.cache(block, *refs[i])
        self.offload.shared_swap_blocks += len(shared)
        self._release_gpu(seq)
        self._swapped[seq.seq_id] = found
        return True

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> Allocation | KVLost | None:
        """GPU blocks for a swapped sequence plus `num_new_tokens`, its KV copied back; None
        (nothing changed) when the GPU pool is short; KVLost when the copy cannot start (the
        sequence holds nothing any more and must be recomputed). A full block found on the GPU
        (still cached, or a sibling's swapped in before) is shared instead of copied back; the
        full blocks copied are made findable at once (they are landing)."""
        cpu_blocks = self._swapped[seq.seq_id]
        refs = list(self._block_refs(seq, 0, seq.num_computed_tokens // self.block_size))
        num_blocks = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        assert num_blocks >= len(cpu_blocks), "swap_out keeps only the blocks of computed tokens"
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
        to_copy = [i for i, block in enumerate(table[: len(cpu_blocks)]) if block is None]
        table = [block if block is not None else next(fresh) for block in table]
        del self._swapped[seq.seq_id]
        self._tables[seq.seq_id], self._block_ids[seq.seq_id] = [], []
        self._extend(seq.seq_id, table)
        self._num_committed[seq.seq_id] = len(refs)
        copied = set(to_copy)
        self.offload.pool.release(block for i, block in enumerate(cpu_blocks) if i not in copied)
        return self._copy_back(seq, refs, [cpu_blocks[i] for i in to_copy], [table[i] for i in to_copy])

    def _copy_back(self, seq: Sequence, refs: list[BlockRef], cpu_blocks: list[Block],
                   gpu_blocks: list[Block]) -> Allocation | KVLost:
        """Copy a swapped sequence's CPU blocks into its new GPU blocks and cache the full ones."""
        if cpu_blocks:
            try:
                self._land(self.offload.copy_in(cpu_blocks, [b.block_id for b in gpu_blocks]), gpu_blocks)
            except TransferError as err:
                self.free(seq)
                return KVLost(str(err))
        keys = {block.block_id: ref for block, ref in zip(self._tables[seq.seq_id], refs, strict=False)}
        for block in gpu_blocks:
            if block.block_id in keys:
                self.pool.cache(block, *keys[block.block_id])
        return SWAPPED_IN

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks in every tier and forget its load plan."""
        self._release_gpu(seq)
        swapped = self._swapped.pop(seq.seq_id, None)
        if swapped:
            self.offload.pool.release(swapped)
        if self.lower is not None:
            self.lower.forget(seq.seq_id)

    def _release_gpu(self, seq: Sequence) -> None:
        # last block first, so that it is evicted first
        self.pool.release(reversed(self._tables.pop(seq.seq_id, [])))
        self._block_ids.pop(seq.seq_id, None)
        self._num_committed.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody owns, on the GPU and in the CPU tier (the lower tier
        keeps its blocks); returns how many were dropped."""
        if self.offload is None:
            return self.pool.drop_unowned()
        self.offload.drain()  # finished transfers still hold blocks until retired
        return self.pool.drop_unowned() + self.offload.pool.drop_unowned()

    def retire(self) -> None:
        """Start a step: release what finished transfers held; last step's copies-in are no
        longer landing (this step's forward pass waits for them)."""
        self._landing_jobs.clear()
        self._landing_blocks.clear()
        if self.offload:
            self.offload.retire()

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
            "cow_block_copies": self.cow_copies,
        }
        if self.offload:
            stats.update(self.offload.stats())
        return stats

    def close(self) -> None:
        if self.offload:
            self.offload.close()


def _run_of(refs: Iterator[BlockRef],
            lookup: Callable[[int, int, tuple[int, ...]], Block | None]) -> tuple[list[Block], BlockRef | None]:
    """The blocks `lookup` finds for the first of `refs`, up to the first miss, and that miss
    (None: every ref was found); what follows the miss is left in `refs`."""
    found = []
    for ref in refs:
        block = lookup(ref.block_hash, ref.parent_hash, ref.token_ids)
        if block is None:
            return found, ref
        found.append(block)
    return found, None
