"""What one engine knows about the blocks on the remote server (not thread-safe: the store's
ledger holds its lock around every call).

    index.stored(h)          # known stored: by this engine (owned) or seen stored by others
    index.absent(h)          # found absent lately: not asked again for MISS_MEMORY_S
    index.own(h); index.remember(h); index.note_absent(h); index.touch(h); index.forget(h)
    index.make_room(most, writing) -> [hashes to delete] | None   # the budget, LRU first
    index.clear()            # the server lost its blocks
"""

from __future__ import annotations

import time
from collections import OrderedDict

MISS_MEMORY_S = 5.0  # a block found absent is not looked up again for this long
MAX_KNOWN_BLOCKS = 1 << 20  # blocks remembered as stored by others, or as absent


class BlockIndex:
    """Blocks this engine stored (LRU order, for its budget), blocks seen stored by others, and
    blocks found absent lately."""

    def __init__(self) -> None:
        self.owned: OrderedDict[int, None] = OrderedDict()  # stored by this engine, LRU first
        self._known: OrderedDict[int, None] = OrderedDict()  # seen stored by others
        self._absent: dict[int, float] = {}  # block -> until when it counts as absent

    def stored(self, block_hash: int) -> bool:
        return block_hash in self.owned or block_hash in self._known

    def absent(self, block_hash: int) -> bool:
        return self._absent.get(block_hash, 0.0) > time.monotonic()

    def note_absent(self, block_hash: int) -> None:
        if len(self._absent) > MAX_KNOWN_BLOCKS:
            self._absent.clear()
        self._absent[block_hash] = time.monotonic() + MISS_MEMORY_S

    def remember(self, block_hash: int) -> None:
        """The block is stored (by another engine, unless this one owns it)."""
        self._absent.pop(block_hash, None)
        if block_hash not in self.owned:
            self._known[block_hash] = None
            self._known.move_to_end(block_hash)
            if len(self._known) > MAX_KNOWN_BLOCKS:
                self._known.popitem(last=False)

    def own(self, block_hash: int) -> None:
        """This engine stored the block."""
        self._absent.pop(block_hash, None)
        self._known.pop(block_hash, None)
        self.owned[block_hash] = None

    def touch(self, block_hash: int) -> None:
        for index in (self.owned, self._known):
            if block_hash in index:
                index.move_to_end(block_hash)

    def forget(self, block_hash: int) -> None:
        self.owned.pop(block_hash, None)
        self._known.pop(block_hash, None)

    def clear(self) -> None:
        self.owned.clear()
        self._known.clear()
        self._absent.clear()

    def make_room(self, most: int, writing: int) -> list[int] | None:
        """Room for one more owned block among at most `most`, with `writing` on their way:
        the owned blocks used least recently that must go (forgotten here; the caller deletes
        them), or None if the writes alone fill the budget."""
        if writing + 1 > most:
            return None
        doomed = []
        while len(self.owned) + writing + 1 > most:
            doomed.append(self.owned.popitem(last=False)[0])
        return doomed
