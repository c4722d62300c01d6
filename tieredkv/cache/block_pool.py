"""The GPU block pool: ids of the blocks in the one KV tensor, their ref counts and hashes.

Operations (O(1) per block; an allocation also steps over the pinned blocks in its way):
- `allocate(n)`: take n blocks from the front of the free queue (evicting cached ones);
  `None` when there are not enough.
- `touch(block)`: take a cached block out of the free queue for a new owner.
- `release(blocks)`: drop one reference each; blocks that reach zero join the back of the
  free queue (cached ones stay findable until they are evicted).
- `cache(block, ...)` / `lookup(hash, ...)` / `cached_block(hash)`: the prefix-cache hash map.
- `refresh(block)`: an unowned cached block was used again: move it to the back.
- `pin(block)` / `unpin(block)`: while its content is read elsewhere (written to disk), a block
  is never allocated, and keeps its place in the free queue.
- `free_blocks()`: the blocks that can be allocated, the next to be taken first;
  `next_victim()`: that one; `next_kept_victim()`: the first of them the pool keeps for its
  own sake (past the empty and the `evict_first` ones); `cold_blocks()`: the cached ones,
  in the order they are evicted; `drop_unowned()`: forget every cached block nobody owns.

Free blocks wait in three queues, taken in turn: empty blocks (never hashed, or forgotten), the
most recently freed first; cached blocks released with `evict_first` (their content is safe
elsewhere), the most recently released first; the other cached blocks, in LRU order (released
ones join the back).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """One block of `block_size` token slots in the GPU KV tensor."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    evict_first: bool = False  # once unowned, evicted before the rest (its content is safe elsewhere)

    def reset_hash(self) -> None:
        self.block_hash = self.parent_hash = self.token_ids = None


EvictCallback = Callable[[Block], None]


class BlockPool:
    """Free queues, ref counts and hash map of `num_blocks` blocks.

    Free blocks wait in three queues (module docstring): empty, expendable (`evict_first`), and
    cached ones in LRU order. `on_evict` is called with a cached block just before its hash is
    dropped, while its KV is still intact: the CPU tier uses it to demote the block (into its own
    pool: the callback never changes this one).
    """

    def __init__(self, num_blocks: int, on_evict: EvictCallback | None = None) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._empty: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._expendable: OrderedDict[int, Block] = OrderedDict()  # cached, evict_first, nobody owns them
        self._free_queue: OrderedDict[int, Block] = OrderedDict()  # cached, nobody owns them, LRU first
        self._cached: dict[int, Block] = {}
        self._pinned: dict[int, Block] = {}  # never allocated, wherever they are
        self._pinned_free = 0  # pinned blocks in the free queues
        self.on_evict = on_evict
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (empty, or cached with no owner; not pinned)."""
        return len(self._empty) + len(self._expendable) + len(self._free_queue) - self._pinned_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def free_blocks(self) -> Iterator[Block]:
        """Blocks that can be allocated, the next to be taken first: the empty ones, then the
        cached ones in the order they are evicted."""
        return itertools.chain(self._unpinned(self._empty), self.cold_blocks())

    def cold_blocks(self) -> Iterator[Block]:
        """Cached blocks that can be allocated (evicted), the next to be evicted first: the
        expendable ones, then the rest from the least recently used on."""
        return itertools.chain(self._unpinned(self._expendable), self._unpinned(self._free_queue))

    def _unpinned(self, queue: OrderedDict[int, Block]) -> Iterator[Block]:
        # pinned blocks are skipped in C, not a Python step each: the CPU tier's coldest blocks
        # are pinned while they are written to disk (hundreds), and each demotion asks past them
        if not self._pinned:
            return iter(queue.values())
        return map(queue.__getitem__, itertools.filterfalse(self._pinned.__contains__, queue))

    def is_free(self, block: Block) -> bool:
        """Whether the block can be allocated now."""
        return self._in_free_queues(block) and block.block_id not in self._pinned

    def is_pinned(self, block: Block) -> bool:
        return block.block_id in self._pinned

    def _in_free_queues(self, block: Block) -> bool:
        block_id = block.block_id
        return block_id in self._empty or block_id in self._expendable or block_id in self._free_queue

    def next_victim(self) -> Block | None:
        """The block `allocate(1)` would take (a cached one is evicted), if any."""
        return next(self.free_blocks(), None)

    def next_kept_victim(self) -> Block | None:
        """The first block allocations would evict once the empty and the expendable blocks
        are taken: the coldest the pool keeps for its own sake, if any."""
        return next(self._unpinned(self._free_queue), None)

    def cached_block(self, block_hash: int) -> Block | None:
        """The block cached under `block_hash`, if any (unverified: see `lookup`)."""
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[Block] | None:
        if n > self.num_free:
            return None
        taken = list(itertools.islice(self.free_blocks(), n))
        for block in taken:
            self._free(block).pop(block.block_id)
            self._evict(block)
            block.ref_count = 1
            block.evict_first = False
        return taken

    def pin(self, block: Block) -> None:
        """Never allocate the block until `unpin`: its content is being read elsewhere. It
        keeps its place in the free queue, and is found, touched and released as before."""
        assert block.block_id not in self._pinned, f"block {block.block_id} is pinned already"
        self._pinned[block.block_id] = block
        self._pinned_free += self._in_free_queues(block)

    def unpin(self, block: Block) -> None:
        del self._pinned[block.block_id]
        self._pinned_free -= self._in_free_queues(block)

    def touch(self, block: Block) -> None:
        """Add an owner to a block found in the prefix cache."""
        if block.ref_count == 0:
            self._free(block).pop(block.block_id)
            self._pinned_free -= block.block_id in self._pinned
        block.ref_count += 1

    def _free(self, block: Block) -> OrderedDict[int, Block]:
        """The free queue a block with no owner is in."""
        if block.block_id in self._free_queue:
            return self._free_queue
        return self._expendable if block.block_id in self._expendable else self._empty

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the given order (the first reaches the
        free queue first, so it is evicted first). Never-hashed blocks go to the front of the
        empty queue, blocks marked `evict_first` to the front of the expendable one."""
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} released more often than owned"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    queue = self._empty
                else:
                    queue = self._expendable if block.evict_first else self._free_queue
                queue[block.block_id] = block
                self._pinned_free += block.block_id in self._pinned
                if queue is not self._free_queue:
                    queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: int, parent_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block with exactly this content, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: Block, block_hash: int, parent_hash: int, token_ids: Sequence[int]) -> None:
        """Make a full, computed block findable. A hash already taken keeps its block."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        self._cached[block_hash] = block

    def refresh(self, block: Block) -> None:
        """A cached block nobody owns was used again: it becomes the last to be evicted."""
        assert block.ref_count == 0, f"block {block.block_id} is owned: it is not in the free queue"
        self._free_queue[block.block_id] = self._free(block).pop(block.block_id)

    def drop_unowned(self) -> int:
        """Forget every cached block nobody owns; how many."""
        unowned = [b for b in self._cached.values() if b.ref_count == 0]
        for block in unowned:
            self.uncache(block)
        return len(unowned)

    def uncache(self, block: Block) -> None:
        """Forget a block's hash without the eviction callback (its content is invalid)."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.reset_hash()
        queue = self._free(block)
        if queue is not self._empty:  # free: it is empty now
            self._empty[block.block_id] = queue.pop(block.block_id)
            self._empty.move_to_end(block.block_id, last=False)

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        del self._cached[block.block_hash]
        block.reset_hash()
        self.num_evictions += 1
