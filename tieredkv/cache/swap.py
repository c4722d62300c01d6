"""The CPU side of preemption by swap: the CPU blocks holding the KV of swapped-out sequences.
Full blocks are found by content on the way out, so a block that forked siblings (or a demoted
prefix) already put in the CPU tier is shared, not copied again.

Operations:
- `swap_out(seq_id, gpu_ids, refs) -> bool`: copy a sequence's GPU blocks into the CPU tier.
- `num_blocks(seq_id)`: the blocks it holds there.
- `copy_back(seq_id, targets) -> job id | None`: copy some of them into GPU blocks and let go
  of all of them (the rest are on the GPU already).
- `share(parent_id, child_id)`: a fork of a swapped-out sequence holds its blocks too.
- `release(seq_id)`: let go of a sequence's blocks without copying them back.
"""

from __future__ import annotations

from tieredkv.cache.block_pool import Block
from tieredkv.cache.offload import CPUOffload
from tieredkv.tiers.backend import BlockRef


class SwapSpace:
    """The CPU blocks each swapped-out sequence holds (blocks of the CPU tier's pool, owned)."""

    def __init__(self, offload: CPUOffload) -> None:
        self.offload = offload
        self._blocks: dict[str, list[Block]] = {}

    def swap_out(self, seq_id: str, gpu_ids: list[int], refs: list[BlockRef]) -> bool:
        """Copy the KV of `gpu_ids` (the first `len(refs)` full, with these content keys) into
        the CPU tier. A full block the tier holds already is shared instead of copied, and the
        full blocks copied are made findable there. False (nothing changed) when there is no
        CPU room or the copy fails."""
        pool = self.offload.pool
        found = [self.offload.lookup(*ref) for ref in refs] + [None] * (len(gpu_ids) - len(refs))
        shared = [block for block in found if block is not None]
        for block in shared:  # held first: the copy below may evict unowned CPU blocks
            pool.touch(block)
        to_copy = [i for i, block in enumerate(found) if block is None]
        copied = self.offload.copy_out([gpu_ids[i] for i in to_copy]) if to_copy else []
        if copied is None:
            pool.release(shared)
            return False
        for i, block in zip(to_copy, copied, strict=True):
            found[i] = block
            if i < len(refs):
                pool.cache(block, *refs[i])
        self.offload.shared_swap_blocks += len(shared)
        self._blocks[seq_id] = found
        return True

    def num_blocks(self, seq_id: str) -> int:
        return len(self._blocks[seq_id])

    def copy_back(self, seq_id: str, targets: dict[int, Block]) -> int | None:
        """Copy the sequence's blocks at the indices of `targets` into those GPU blocks (one
        H2D job: its id; None if there is nothing to copy) and let go of the others. The
        sequence holds no CPU blocks afterwards. Raises TransferError when the copy cannot
        start."""
        cpu_blocks = self._blocks.pop(seq_id)
        self.offload.pool.release(block for i, block in enumerate(cpu_blocks) if i not in targets)
        if not targets:
            return None
        return self.offload.copy_in([cpu_blocks[i] for i in targets], [b.block_id for b in targets.values()])

    def share(self, parent_id: str, child_id: str) -> None:
        """The child holds every CPU block the parent holds (nothing if it is not swapped out)."""
        blocks = self._blocks.get(parent_id)
        if blocks is None:
            return
        for block in blocks:
            self.offload.pool.touch(block)
        self._blocks[child_id] = list(blocks)

    def release(self, seq_id: str) -> None:
        """Let go of the sequence's CPU blocks, if it holds any."""
        blocks = self._blocks.pop(seq_id, None)
        if blocks:
            self.offload.pool.release(blocks)
