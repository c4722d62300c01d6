"""`RankStores` (here `ShardedStore`, the NVMe tier of a tensor-parallel engine): a block is
stored only where every rank's store holds its slice."""

from __future__ import annotations

import time

import torch

from tieredkv.parallel.sharded_tiers import ShardedStore
from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.nvme import NVMeStore
from tieredkv.tiers.nvme.slot_format import aligned_empty

BLOCK_BYTES = 4096
BLOCK_SIZE = 4
REF = BlockRef(0xB10C, 0, (1, 2, 3, 4))


class RefusingStore(NVMeStore):
    """An NVMe store that starts no write while `refuse` is set, as one with no room."""

    refuse = False

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        return None if self.refuse else super().submit_write(ref, src)


def slices(fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's two slices, byte i of rank r's `i + fill + r` (all zero with no fill)."""
    parts = (aligned_empty(BLOCK_BYTES), aligned_empty(BLOCK_BYTES))
    for rank, part in enumerate(parts):
        if fill:
            part.copy_(torch.arange(BLOCK_BYTES, dtype=torch.uint8) + fill + rank)
        else:
            part.zero_()
    return parts


def test_a_write_one_rank_refuses_leaves_the_block_unstored_and_unreported(tmp_path):
    stores = [RefusingStore(tmp_path / f"rank{rank}", 8 * (BLOCK_BYTES + 8192), BLOCK_BYTES, b"ranks", BLOCK_SIZE)
              for rank in range(2)]
    ranks = ShardedStore(stores)
    try:
        stores[1].refuse = True
        src = slices(fill=7)
        assert ranks.submit_write(REF, src) is None  # rank 1 has no room: the block cannot be whole
        deadline = time.monotonic() + 10
        while not stores[0].contains(REF.block_hash):  # rank 0's write runs on
            assert ranks.poll() == [], "a write that cannot make the block whole was reported"
            assert time.monotonic() < deadline, "rank 0's write never finished"
            time.sleep(0.01)
        assert ranks.poll() == [] and not ranks.contains(REF.block_hash)
        assert ranks.submit_read(REF, slices()) is None  # a miss: nobody reads half a block

        stores[1].refuse = False  # room again: the next write makes it whole
        job = ranks.submit_write(REF, src)
        assert job is not None and ranks.wait([job], timeout=10) == {job: True}
        assert ranks.contains(REF.block_hash)
        dst = slices()
        read = ranks.submit_read(REF, dst)
        assert read is not None and ranks.wait([read], timeout=10) == {read: True}
        assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))
        stats = ranks.stats()
        assert (stats["hits"], stats["misses"], stats["writes"]) == (1, 1, 1)
    finally:
        ranks.close()
