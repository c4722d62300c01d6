"""Each sequence's GPU blocks, in token order: the block table the model runner reads, how many
of its first blocks are committed (findable by content), and copy-on-write for the blocks
forked sequences share. A table's reference to a block is one pool reference: the tables take
and drop them.

Operations:
- `start(seq_id, blocks)` / `extend(seq_id, blocks)`: a sequence's first blocks, then more.
- `blocks(seq_id)` / `ids(seq_id)`: its blocks, and their ids (do not modify either).
- `num_committed(seq_id)` / `set_committed(seq_id, n)`: its first blocks made findable.
- `share(parent_id, child_id)`: a fork: the child holds every block of the parent.
- `copy_on_write(seq_id, index, copy)`: the sequence writes into `copy`, not its shared block
  `index`; `take_copies()`: those copies, to run before the next forward pass.
- `release(seq_id)`: drop the sequence's references, last block first.

Copy-on-write: forked sequences share blocks by reference count. Only a shared block that is
not full can be written (full blocks are never rewritten); the first sibling to write into it
gets a copy, and the last one writes in place:

    parent [b0 b1 b2*]      fork       a [b0 b1 b2*]  b [b0 b1 b2*]   (b2: 5 of 16 slots, ref 2)
    a computes token 5:  a [b0 b1 b7]  b [b0 b1 b2]   (b7 = copy of b2, then slot 5 written)
"""

from __future__ import annotations

from tieredkv.cache.block_pool import Block, BlockPool


class BlockTables:
    """The GPU blocks each sequence holds, by sequence id."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._blocks: dict[str, list[Block]] = {}
        self._ids: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) this step
        self.cow_copies = 0

    def blocks(self, seq_id: str) -> list[Block] | None:
        """The sequence's blocks in token order (None: it holds no GPU blocks)."""
        return self._blocks.get(seq_id)

    def ids(self, seq_id: str) -> list[int]:
        """Block ids of the sequence, in token order."""
        return self._ids.get(seq_id, [])

    def start(self, seq_id: str, blocks: list[Block]) -> None:
        """The sequence's first blocks (owned already), none of them committed yet."""
        self._blocks[seq_id], self._ids[seq_id] = [], []
        self._num_committed[seq_id] = 0
        self.extend(seq_id, blocks)

    def extend(self, seq_id: str, blocks: list[Block]) -> None:
        self._blocks[seq_id].extend(blocks)
        self._ids[seq_id].extend(b.block_id for b in blocks)

    def num_committed(self, seq_id: str) -> int:
        return self._num_committed[seq_id]

    def set_committed(self, seq_id: str, num_blocks: int) -> None:
        self._num_committed[seq_id] = num_blocks

    def share(self, parent_id: str, child_id: str) -> None:
        """The child holds every block the parent holds (nothing if the parent holds none)."""
        blocks = self._blocks.get(parent_id)
        if blocks is None:
            return
        for block in blocks:
            self.pool.touch(block)
        self._blocks[child_id] = list(blocks)
        self._ids[child_id] = list(self._ids[parent_id])
        self._num_committed[child_id] = self._num_committed[parent_id]

    def copy_on_write(self, seq_id: str, index: int, copy: Block) -> None:
        """Give the sequence `copy` in place of its shared block `index`; the copy is made
        before the next forward pass writes into it."""
        blocks = self._blocks[seq_id]
        shared, blocks[index] = blocks[index], copy
        self._ids[seq_id][index] = copy.block_id
        self.pool.release([shared])  # its other owners keep it
        self._copies.append((shared.block_id, copy.block_id))
        self.cow_copies += 1

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies made since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def release(self, seq_id: str) -> None:
        """Drop the sequence's references; last block first, so that it is evicted first."""
        self.pool.release(reversed(self._blocks.pop(seq_id, [])))
        self._ids.pop(seq_id, None)
        self._num_committed.pop(seq_id, None)
