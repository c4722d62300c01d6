"""The KV cache manager: the scheduler's only door to blocks.

Operations:
- `match_prefix(seq) -> PrefixMatch`: the longest run of cached full blocks of the sequence.
- `allocate(seq, num_new_tokens, prefix) -> Allocation | None`: blocks for the next tokens
  (`None`, with nothing changed, when the pool is short).
- `commit(seq)`: make newly computed full blocks findable by later requests.
- `free(seq)`: give the sequence's blocks back (cached ones stay findable).
- `block_table(seq)`: the block ids the model runner reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.sequence import Sequence


@dataclass(frozen=True)
class PrefixMatch:
    """Cached GPU blocks that hold the first `num_tokens` tokens of a sequence."""

    blocks: tuple[Block, ...] = ()

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


@dataclass(frozen=True)
class Allocation:
    """What `allocate` gave: fresh block ids and the prefix tokens reused from the cache."""

    new_block_ids: tuple[int, ...]
    num_cached_tokens: int


NO_NEW_BLOCKS = Allocation((), 0)


class KVCacheManager:
    """Maps sequences to GPU blocks with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, root_hash: int) -> None:
        self.block_size = block_size
        self.root_hash = root_hash
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[Block]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        """Block ids of the sequence, in token order (do not modify)."""
        return self._block_ids.get(seq.request_id, [])

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        # At least one token must be computed to get logits, so a full hit stops one block short.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.root_hash)
        found: list[Block] = []
        parent = self.root_hash
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            block = self.pool.lookup(hashes[i], parent, tokens)
            if block is None:
                break
            found.append(block)
            parent = hashes[i]
        return PrefixMatch(tuple(found))

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixMatch | None = None) -> Allocation | None:
        """Blocks for `num_new_tokens` more tokens. A new sequence passes its `prefix`; its
        computed-token count then starts after the reused blocks."""
        table = self._tables.get(seq.request_id)
        if table is not None:
            need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(table)
            if need <= 0:
                return NO_NEW_BLOCKS
            fresh = self.pool.allocate(need)
            if fresh is None:
                return None
            self._extend(seq.request_id, fresh)
            return Allocation(tuple(b.block_id for b in fresh), 0)
        return self._allocate_new(seq, num_new_tokens, prefix.blocks if prefix else ())

    def _allocate_new(self, seq: Sequence, num_new_tokens: int, reused: tuple[Block, ...]) -> Allocation | None:
        num_cached = len(reused) * self.block_size
        need = self.blocks_needed(num_cached + num_new_tokens) - len(reused)
        # reused blocks with no owner sit in the free queue: taking them shrinks it too
        idle = sum(1 for b in reused if b.ref_count == 0)
        if need + idle > self.pool.num_free:
            return None
        for block in reused:
            self.pool.touch(block)
        fresh = self.pool.allocate(need)
        assert fresh is not None, "free count checked above"
        self._tables[seq.request_id], self._block_ids[seq.request_id] = [], []
        self._extend(seq.request_id, [*reused, *fresh])
        self._num_committed[seq.request_id] = len(reused)
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        self.prefix_hit_tokens += num_cached
        return Allocation(tuple(b.block_id for b in fresh), num_cached)

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

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last block first (so it is evicted first)."""
        table = self._tables.pop(seq.request_id, [])
        self._block_ids.pop(seq.request_id, None)
        self._num_committed.pop(seq.request_id, None)
        self.pool.release(reversed(table))

    def stats(self) -> dict[str, int]:
        used = self.num_blocks - self.pool.num_free
        return {
            "gpu_blocks_total": self.num_blocks,
            "gpu_blocks_used": used,
            "gpu_blocks_cached": self.pool.num_cached,
            "gpu_blocks_free": self.pool.num_free,
            "gpu_evictions": self.pool.num_evictions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        }
