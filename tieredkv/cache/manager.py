"""The KV cache manager: the scheduler's only door to blocks, in every tier.

Operations:
- `match_prefix(seq) -> PrefixMatch`: the longest run of cached full blocks of the sequence,
  on the GPU, then in the CPU tier, then on NVMe.
- `start_loads(seq, refs)` / `loading(seq)`: bring NVMe prefix blocks into the CPU tier
  ahead of the sequence's admission.
- `allocate(seq, num_new_tokens, prefix) -> Allocation | None`: blocks for the next tokens
  (`None`, with nothing changed, when the GPU pool is short); CPU hits are promoted.
- `commit(seq)`: make newly computed full blocks findable by later requests.
- `swap_out(seq) -> bool` / `swap_in(seq, num_new_tokens) -> Allocation | None`: move a
  preempted sequence's KV to the CPU tier and back.
- `free(seq)`: give the sequence's blocks back (cached ones stay findable).
- `block_table(seq)`: the block ids the model runner reads and writes.
- `landing(seq)`: whether the sequence's KV is still being copied in by a job submitted this
  step; such a sequence computes from the next step on, so that this step's forward pass does
  not wait for the copy (it overlaps the copy instead).
- `retire()` / `before_forward()`: finish transfers; order the next forward pass after them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.cache.offload import BlockRef, CPUOffload
from tieredkv.sequence import Sequence
from tieredkv.transfer.engine import TransferError


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks holding the first tokens of a sequence: GPU blocks, then CPU blocks,
    then blocks on NVMe (usable once loaded into the CPU tier)."""

    gpu_blocks: tuple[Block, ...] = ()
    cpu_blocks: tuple[Block, ...] = ()
    nvme_refs: tuple[BlockRef, ...] = ()

    def num_tokens(self, block_size: int) -> int:
        """Tokens usable now (GPU and CPU hits)."""
        return (len(self.gpu_blocks) + len(self.cpu_blocks)) * block_size


@dataclass(frozen=True)
class Allocation:
    """What `allocate` gave: fresh block ids and the prefix tokens reused from the cache."""

    new_block_ids: tuple[int, ...]
    num_cached_tokens: int


NO_NEW_BLOCKS = Allocation((), 0)


class KVCacheManager:
    """Maps sequences to GPU blocks with prefix caching; optionally backed by a CPU tier."""

    def __init__(self, num_blocks: int, block_size: int, root_hash: int, offload: CPUOffload | None = None) -> None:
        self.block_size = block_size
        self.root_hash = root_hash
        self.offload = offload
        self.pool = BlockPool(num_blocks, on_evict=offload.demote if offload else None)
        self._tables: dict[str, list[Block]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}
        self._swapped: dict[str, list[Block]] = {}
        # H2D copies submitted this step, the sequences that read them and their GPU blocks
        self._landing_jobs: set[int] = set()
        self._landing: set[str] = set()
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
        return self._block_ids.get(seq.request_id, [])

    def cpu_free_blocks(self) -> int:
        return self.offload.num_free if self.offload else 0

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        found: list[list[Block]] = [[], []]
        on_disk: list[BlockRef] = []
        tier = 0
        for block_hash, parent, tokens in self._full_blocks(seq):
            block = self.pool.lookup(block_hash, parent, tokens) if tier == 0 else None
            if block is None and self.offload is not None and tier <= 1:
                tier = 1
                block = self.offload.lookup(block_hash, parent, tokens)
            if block is not None:
                found[tier].append(block)
            elif self.offload is not None and self.offload.nvme_contains(block_hash):
                tier = 2  # the store verifies parent and tokens when it reads the block
                on_disk.append(BlockRef(block_hash, parent, tuple(tokens)))
            else:
                break
        return PrefixMatch(tuple(found[0]), tuple(found[1]), tuple(on_disk))

    def _full_blocks(self, seq: Sequence, start: int = 0) -> Iterator[tuple[int, int, list[int]]]:
        """(hash, parent hash, tokens) of the sequence's full blocks from block `start` on that a
        prefix hit may cover: at least one token must be computed to get logits, so a full hit
        stops one block short."""
        bs = self.block_size
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, bs, self.root_hash)
        for i in range(start, (seq.num_tokens - 1) // bs):
            yield hashes[i], hashes[i - 1] if i else self.root_hash, seq.token_ids[i * bs : (i + 1) * bs]

    def start_loads(self, seq: Sequence, refs: tuple[BlockRef, ...]) -> int:
        """Start reading NVMe prefix blocks into the CPU tier; how many reads started."""
        return self.offload.start_loads(seq.request_id, list(refs)) if refs else 0

    def skip_loaded(self, seq: Sequence) -> int:
        """Jump the sequence's prefill over prefix blocks that its NVMe loads brought into the
        CPU tier: copy them into its next GPU blocks and count them computed. Returns the
        number of blocks skipped (0 if none arrived intact or the GPU pool is short)."""
        bs = self.block_size
        start = seq.num_computed_tokens // bs
        found = [] if seq.num_computed_tokens % bs else self._cpu_run(seq, start)
        skipped = self._copy_loaded(seq, start, found) if found else 0
        self.offload.release_loads(seq.request_id)
        return skipped

    def _cpu_run(self, seq: Sequence, start: int) -> list[Block]:
        """The CPU-tier blocks holding the sequence's full blocks from block `start` on."""
        found = []
        for block_hash, parent, tokens in self._full_blocks(seq, start):
            block = self.offload.lookup(block_hash, parent, tokens)
            if block is None:
                break
            found.append(block)
        return found

    def _copy_loaded(self, seq: Sequence, start: int, cpu_blocks: list[Block]) -> int:
        table = self._tables[seq.request_id]
        need = start + len(cpu_blocks) - len(table)
        if need > self.pool.num_free:
            return 0
        for block in cpu_blocks:
            self.offload.pool.touch(block)
        self._extend(seq.request_id, self.pool.allocate(max(need, 0)) or [])
        if not self._promote(seq, cpu_blocks, table[start : start + len(cpu_blocks)]):
            return 0
        seq.num_computed_tokens += len(cpu_blocks) * self.block_size
        self._count_hit(seq, len(cpu_blocks) * self.block_size)
        self._num_committed[seq.request_id] = start + len(cpu_blocks)
        return len(cpu_blocks)

    def _count_hit(self, seq: Sequence, num_tokens: int, num_gpu_blocks: int = 0) -> None:
        """Count prompt tokens reused from a cache (`num_gpu_blocks` of them found on the GPU):
        a client's prompt, not a recomputed sequence finding its own blocks again."""
        if not seq.recomputing:
            seq.num_cached_tokens += num_tokens
            self.prefix_hit_tokens += num_tokens
            self.gpu_hit_blocks += num_gpu_blocks

    def loading(self, seq: Sequence) -> bool:
        """Whether NVMe reads for this sequence are still in flight."""
        return self.offload is not None and self.offload.loading(seq.request_id)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> Allocation | None:
        """Blocks for `num_new_tokens` more tokens. A new sequence passes its `prefix`; its
        computed-token count then starts after the reused blocks."""
        table = self._tables.get(seq.request_id)
        if table is None:
            return self._allocate_new(seq, num_new_tokens, prefix or PrefixMatch())
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if need <= 0:
            return NO_NEW_BLOCKS
        fresh = self.pool.allocate(need)
        if fresh is None:
            return None
        self._extend(seq.request_id, fresh)
        return Allocation(tuple(b.block_id for b in fresh), 0)

    def _allocate_new(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch) -> Allocation | None:
        reused, promoted = prefix.gpu_blocks, list(prefix.cpu_blocks)
        need = self.blocks_needed(prefix.num_tokens(self.block_size) + num_new_tokens) - len(reused)
        # reused blocks with no owner sit in the free queue: taking them shrinks it too
        idle = sum(1 for b in reused if b.ref_count == 0)
        if need + idle > self.pool.num_free:
            return None
        for block in promoted:  # hold them: demotions below could otherwise evict them
            self.offload.pool.touch(block)
        if self.offload is not None:
            self.offload.release_loads(seq.request_id)
        for block in reused:
            self.pool.touch(block)
        if any(b.block_id in self._landing_blocks for b in reused):  # another request's promotion
            self._landing.add(seq.request_id)
        fresh = self.pool.allocate(need)
        assert fresh is not None, "free count checked above"
        self._tables[seq.request_id], self._block_ids[seq.request_id] = [], []
        self._extend(seq.request_id, [*reused, *fresh])
        num_hit_blocks = len(reused) + self._promote(seq, promoted, fresh)
        self._num_committed[seq.request_id] = num_hit_blocks
        num_cached = num_hit_blocks * self.block_size
        seq.num_computed_tokens = num_cached
        self._count_hit(seq, num_cached, len(reused))
        return Allocation(tuple(b.block_id for b in fresh), num_cached)

    def _promote(self, seq: Sequence, cpu_blocks: list[Block], gpu_blocks: list[Block]) -> int:
        """Copy CPU prefix blocks into the first of `gpu_blocks` and cache them there; how many
        arrived (0 if the copy failed: the tokens are recomputed instead)."""
        if not cpu_blocks:
            return 0
        targets = gpu_blocks[: len(cpu_blocks)]
        try:
            self._land(seq, self.offload.copy_in(cpu_blocks, [b.block_id for b in targets]), targets)
        except TransferError:
            return 0  # the tokens are recomputed instead
        for src, dst in zip(cpu_blocks, targets, strict=True):
            self.pool.cache(dst, src.block_hash, src.parent_hash, src.token_ids)
        self.offload.hit_blocks += len(cpu_blocks)
        return len(cpu_blocks)

    def _land(self, seq: Sequence, job_id: int, gpu_blocks: list[Block]) -> None:
        self._landing_jobs.add(job_id)
        self._landing.add(seq.request_id)
        self._landing_blocks.update(b.block_id for b in gpu_blocks)

    def landing(self, seq: Sequence) -> bool:
        return seq.request_id in self._landing

    def _extend(self, request_id: str, blocks: list[Block]) -> None:
        self._tables[request_id].extend(blocks)
        self._block_ids[request_id].extend(b.block_id for b in blocks)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        done = self._num_committed[seq.request_id]
        if full <= done:
            return
        table = self._tables[seq.request_id]
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.root_hash)
        for i in range(done, full):
            parent = hashes[i - 1] if i else self.root_hash
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.pool.cache(table[i], hashes[i], parent, tokens)
        self._num_committed[seq.request_id] = full

    def swap_out(self, seq: Sequence) -> bool:
        """Copy all of the sequence's blocks (the partial last one too) to the CPU tier and free
        them on the GPU. False (nothing changed) when there is no CPU room or the copy fails."""
        if self.offload is None:
            return False
        cpu_blocks = self.offload.copy_out(self.block_table(seq))
        if cpu_blocks is None:
            return False
        self._release_gpu(seq)
        self._swapped[seq.request_id] = cpu_blocks
        return True

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> Allocation | None:
        """GPU blocks for a swapped sequence plus `num_new_tokens`, its KV copied back; None when
        the GPU pool is short. Raises TransferError (the KV is lost: recompute it)."""
        cpu_blocks = self._swapped[seq.request_id]
        fresh = self.pool.allocate(self.blocks_needed(seq.num_computed_tokens + num_new_tokens))
        if fresh is None:
            return None
        del self._swapped[seq.request_id]
        self._tables[seq.request_id], self._block_ids[seq.request_id] = [], []
        self._extend(seq.request_id, fresh)
        self._num_committed[seq.request_id] = 0
        targets = fresh[: len(cpu_blocks)]
        try:
            self._land(seq, self.offload.copy_in(cpu_blocks, [b.block_id for b in targets]), targets)
        except TransferError:
            self._release_gpu(seq)
            raise
        return Allocation(tuple(b.block_id for b in fresh), 0)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks in every tier."""
        self._release_gpu(seq)
        swapped = self._swapped.pop(seq.request_id, None)
        if swapped:
            self.offload.pool.release(swapped)
        if self.offload is not None:
            self.offload.release_loads(seq.request_id)

    def _release_gpu(self, seq: Sequence) -> None:
        # last block first, so that it is evicted first
        self.pool.release(reversed(self._tables.pop(seq.request_id, [])))
        self._block_ids.pop(seq.request_id, None)
        self._num_committed.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody owns, on the GPU and in the CPU tier (the NVMe store
        keeps its blocks); returns how many were dropped."""
        if self.offload:
            self.offload.drain()  # finished transfers still hold blocks until retired
        pools = [self.pool] + ([self.offload.pool] if self.offload else [])
        dropped = 0
        for pool in pools:
            for block in list(pool.cached.values()):
                if block.ref_count == 0:
                    pool.uncache(block)
                    dropped += 1
        return dropped

    def retire(self) -> None:
        """Start a step: release what finished transfers held; last step's copies-in are no
        longer landing (this step's forward pass waits for them)."""
        self._landing_jobs.clear()
        self._landing.clear()
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
        }
        if self.offload:
            stats.update(self.offload.stats())
        return stats

    def close(self) -> None:
        if self.offload:
            self.offload.close()
