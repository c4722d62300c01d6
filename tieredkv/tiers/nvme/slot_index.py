"""Which slot of the NVMe store holds which block, and which block a full store gives up;
pure bookkeeping, no I/O.

A block is *writing* from `reserve` until `commit` (stored) or `abort` (dropped). A stored block
is *pinned* while reads of it are in flight, and an evicted or discarded slot is not reused
until its last read finished. Reserving, reading and touching a block make it the most recent,
so blocks written together keep the order they were submitted in, whatever order their writes
finish in.

When the store is full, the replacement policy (`tieredkv/replacement.py`, by name: `lru`,
`tinylfu` or `adaptive`, as the CPU tier's) picks: the victim is the least recently used stored
block that is not pinned, and the new block takes its slot if the policy `admits` it (else the
write is `Declined`). Under `tinylfu` and `adaptive` a chain's tail goes before its head: a
victim with stored children gives way to a descendant with none (a prefix is read from its
head, so a block whose parent is gone is never hit, and the head is worth the most)::

    LRU order: [h0 x h1 h2]  (h0 -> h1 -> h2 one chain)   victim: h2, then h1, then h0

The policy learns from `offered(hash)` (each block the tier above offers) and `record(hashes,
num_hits_above)` (each request: its blocks past those found above). Under `lru` neither matters.

Operations: `lookup`, `known`, `touch`, `reserve`, `commit`, `abort`, `pin`, `unpin`,
`discard`, `restore`, `stored_hashes`, `offered`, `record`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tieredkv.replacement import ReplacementPolicy, make_admission


@dataclass(frozen=True)
class Reservation:
    """A slot to write a block into, and the block evicted to free it (if any)."""

    slot: int
    evicted: int | None


@dataclass(frozen=True)
class Declined:
    """The store is full and the policy keeps `victim` rather than the new block."""

    victim: int


class SlotIndex:
    """Maps block hashes to slots; tracks free slots, recency, chains and in-flight reads, and
    picks victims by a replacement policy (module docstring)."""

    def __init__(self, num_slots: int, policy: ReplacementPolicy = "lru") -> None:
        self.num_slots = num_slots
        self.policy = make_admission(policy, num_slots)
        self._tails_first = policy != "lru"
        self._parents: dict[int, int] = {}  # hash -> parent hash, for blocks held (and known)
        self._children: dict[int, dict[int, None]] = {}  # parent hash -> held children, oldest link first
        self._descent: tuple[int, int] | None = None  # (oldest block, where its last tail walk ended)
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

    def reserve(self, block_hash: int, parent_hash: int | None = None) -> Reservation | Declined | None:
        """A slot for a new block (whose chain parent is `parent_hash`, if known): a free one,
        else the victim's if the policy admits the new block; None if all blocks are busy."""
        assert not self.known(block_hash), (
            f"block {block_hash:#x} is already stored or being written"
        )
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self._victim()
            if evicted is None:
                return None
            if not self.policy.admits(block_hash, evicted):
                return Declined(evicted)
            slot = self._forget(evicted)
        self._lru[block_hash] = slot
        self._writing.add(block_hash)
        self._link(block_hash, parent_hash)
        return Reservation(slot, evicted)

    def offered(self, block_hash: int) -> None:
        """The tier above offered the block (stored already or not): the policy counts it."""
        self.policy.offered(block_hash)

    def record(self, block_hashes: Sequence[int], num_hits_above: int = 0) -> None:
        """A request for a prompt's full blocks, of which the first `num_hits_above` were found in
        the tiers above and the rest asked of the store: the policy counts it."""
        self.policy.record(block_hashes, num_hits_above)

    def commit(self, block_hash: int) -> None:
        """The block's write finished: it is stored (where `reserve` put it in the LRU order)."""
        self._writing.remove(block_hash)

    def abort(self, block_hash: int) -> None:
        """The block's write failed: its slot is free again."""
        self._writing.remove(block_hash)
        self._free.append(self._forget(block_hash))

    def pin(self, block_hash: int, parent_hash: int | None = None) -> int | None:
        """Start a read of a stored block: returns its slot (now most recent), or None. A
        restored block learns its chain parent here."""
        slot = self.lookup(block_hash)
        if slot is not None:
            self._lru.move_to_end(block_hash)
            if block_hash not in self._parents:
                self._link(block_hash, parent_hash)
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
        slot = self._forget(block_hash)
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

    # ---------------------------------------------------------------- victims and chains

    def _evictable(self, block_hash: int) -> bool:
        return block_hash not in self._writing and self._lru[block_hash] not in self._pins

    def _victim(self) -> int | None:
        """The block a full store gives up: the least recently used evictable one, or under a
        chain-aware policy the tail below it (module docstring); None if all are busy."""
        oldest = next((h for h in self._lru if self._evictable(h)), None)
        if oldest is None or not self._tails_first:
            return oldest
        start = oldest
        if self._descent is not None and self._descent[0] == oldest:
            resume = self._descent[1]  # a chain is given up tail first: resume where the last walk ended
            if resume in self._lru and self._evictable(resume):
                start = resume
        victim = self._tail_below(start)
        self._descent = (oldest, self._parents[victim]) if victim != oldest else None
        return victim

    def _tail_below(self, block_hash: int) -> int:
        """Follow evictable children from `block_hash` to a block that has none."""
        for _ in range(len(self._lru)):  # bounded: a crafted parent hash could make a cycle
            child = next((c for c in self._children.get(block_hash, ()) if self._evictable(c)), None)
            if child is None:
                break
            block_hash = child
        return block_hash

    def _link(self, block_hash: int, parent_hash: int | None) -> None:
        if parent_hash is not None:
            self._parents[block_hash] = parent_hash
            self._children.setdefault(parent_hash, {})[block_hash] = None

    def _forget(self, block_hash: int) -> int:
        """Drop a block from the order and its chain; returns its slot."""
        parent = self._parents.pop(block_hash, None)
        if parent is not None:
            siblings = self._children[parent]
            del siblings[block_hash]
            if not siblings:
                del self._children[parent]
        return self._lru.pop(block_hash)
