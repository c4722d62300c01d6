"""Which slot of the NVMe store holds which block, in LRU order; pure bookkeeping, no I/O.

A block is *writing* from `reserve` until `commit` (stored) or `abort` (dropped). A stored block
is *pinned* while reads of it are in flight, and an evicted or discarded slot is not reused
until its last read finished. Eviction takes the least recently used stored block that is not
pinned. Reserving, reading and touching a block make it the most recent, so blocks written
together keep the order they were submitted in, whatever order their writes finish in.

Operations: `lookup`, `known`, `touch`, `reserve`, `commit`, `abort`, `pin`, `unpin`,
`discard`, `restore`, `stored_hashes`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Reservation:
    """A slot to write a block into, and the block evicted to free it (if any)."""

    slot: int
    evicted: int | None


class SlotIndex:
    """Maps block hashes to slots; tracks free slots, LRU order and in-flight reads."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest first; writing too
        self._writing: set[int] = set()  # hashes reserved and not committed yet
        self._pins: dict[int, int] = {}  # slot -> reads in flight
        self._orphans: set[int] = set()  # pinned slots whose block is gone: free once unpinned

    @property
    def num_stored(self) -> int:
        return len(self._lru) - len(self._writing)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: int) -> int | None:
        """The slot of a stored block, or None."""
        return None if block_hash in self._writing else self._lru.get(block_hash)

    def known(self, block_hash: int) -> bool:
        """True if the block is stored or being written."""
        return block_hash in self._lru

    def touch(self, block_hash: int) -> None:
        """Make a stored or writing block the most recently used."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def stored_hashes(self) -> list[int]:
        """Stored blocks, least recently used first."""
        return [h for h in self._lru if h not in self._writing]

    def reserve(self, block_hash: int) -> Reservation | None:
        """A slot for a new block: a free one, else the LRU unpinned block's; None if all are busy."""
        assert not self.known(block_hash), (
            f"block {block_hash:#x} is already stored or being written"
        )
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next(
                (h for h, s in self._lru.items() if h not in self._writing and s not in self._pins),
                None,
            )
            if evicted is None:
                return None
            slot = self._lru.pop(evicted)
        self._lru[block_hash] = slot
        self._writing.add(block_hash)
        return Reservation(slot, evicted)

    def commit(self, block_hash: int) -> None:
        """The block's write finished: it is stored (where `reserve` put it in the LRU order)."""
        self._writing.remove(block_hash)

    def abort(self, block_hash: int) -> None:
        """The block's write failed: its slot is free again."""
        self._writing.remove(block_hash)
        self._free.append(self._lru.pop(block_hash))

    def pin(self, block_hash: int) -> int | None:
        """Start a read of a stored block: returns its slot (now most recent), or None."""
        slot = self.lookup(block_hash)
        if slot is not None:
            self._lru.move_to_end(block_hash)
            self._pins[slot] = self._pins.get(slot, 0) + 1
        return slot

    def unpin(self, slot: int) -> None:
        """A read of `slot` finished."""
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return
        del self._pins[slot]
        if slot in self._orphans:
            self._orphans.remove(slot)
            self._free.append(slot)

    def discard(self, block_hash: int) -> None:
        """Forget a stored block (failed verification); its slot is freed when no read uses it."""
        if self.lookup(block_hash) is None:
            return
        slot = self._lru.pop(block_hash)
        if slot in self._pins:
            self._orphans.add(slot)
        else:
            self._free.append(slot)

    def restore(self, blocks: list[tuple[int, int]]) -> None:
        """Load (block_hash, slot) pairs found on disk, least recently used first."""
        assert not self._lru, "restore() needs an empty index"
        used = {slot for _, slot in blocks}
        self._lru = OrderedDict(blocks)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
