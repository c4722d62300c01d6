"""What every tier below the CPU answers: a store of KV blocks known by content.

    ref = BlockRef(block_hash, parent_hash, token_ids)
    store.contains(ref.block_hash)
    store.contains_run([h0, h1, ...]) -> n # the first n are stored: one question for a prefix
    job = store.submit_write(ref, src)     # None: nothing started (stored already, or no room)
    job = store.submit_read(ref, dst)      # None: not stored (a miss)
    jobs = store.submit_reads([(ref, dst), ...])  # in order, up to the first miss: one job each
    store.poll() -> [(job, ok), ...]       # jobs finished since the last poll
    store.wait([job, ...]) -> {job: ok}    # blocks the caller
    store.record([h0, h1, ...], n)         # a request asked for these blocks (the first n found above)
    store.take_lost() -> LostBlocks        # blocks it held and lost since last asked (or all of them)
    store.stats(); store.close()

`src` and `dst` are one CPU block each and stay untouched until their job is reported. A read
that comes back `ok=False` left garbage in `dst`: the caller recomputes. The NVMe store is one
implementation; a remote store is another. A store subclasses `BlockStore`, which gives it
`submit_reads` as `submit_read` block by block; the NVMe store hands a batch to the disk at once.
A store that can lose blocks it held, other than by its own policy's choice (a read finds one
damaged or gone, its file or server loses them all), keeps a `LossLog` and answers `take_lost`
from it: the tier above remembers which blocks are stored (so as not to write them twice) and
forgets these. A block the store's policy evicted stays remembered: which blocks to keep is the
store's choice, and writing each one again would evict another, without end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch


class BlockRef(NamedTuple):
    """A full block known by content: its chained hash, its parent's, its tokens."""

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


class LostBlocks(NamedTuple):
    """Blocks a store held and no longer does: those of `block_hashes`, or, with `everything`,
    all it held (its file or server lost them, or it lost more than it lists)."""

    everything: bool = False
    block_hashes: frozenset[int] = frozenset()

    @staticmethod
    def merge(parts: Iterable[LostBlocks]) -> LostBlocks:
        """What several stores lost, as one store's."""
        lost = list(parts)
        if any(part.everything for part in lost):
            return LostBlocks(everything=True)
        return LostBlocks(block_hashes=frozenset().union(*(part.block_hashes for part in lost)))


MAX_LOST_LISTED = 1 << 16  # lost blocks a `LossLog` lists; past it, it says all were lost


class LossLog:
    """The blocks a store lost since `take` was last called (not thread-safe: the store holds
    its lock around every call). Up to `MAX_LOST_LISTED` are listed: a store nobody asks keeps
    no more than that."""

    def __init__(self) -> None:
        self._everything = False
        self._hashes: set[int] = set()

    def lose(self, block_hash: int) -> None:
        if not self._everything:
            self._hashes.add(block_hash)
            if len(self._hashes) > MAX_LOST_LISTED:
                self.lose_all()

    def lose_all(self) -> None:
        self._everything, self._hashes = True, set()

    def take(self) -> LostBlocks:
        lost = LostBlocks(self._everything, frozenset(self._hashes))
        self._everything, self._hashes = False, set()
        return lost


class BlockStore(ABC):
    """A tier of KV blocks with two-phase reads and writes (see the module docstring). Stores
    subclass it, for the default `submit_reads`; a store that misses a method cannot be made."""

    @abstractmethod
    def contains(self, block_hash: int) -> bool: ...

    @abstractmethod
    def contains_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading `block_hashes` the store holds (the run up to its first
        miss), asked at once: a remote store pays one round trip for them all."""
        ...

    @abstractmethod
    def record(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        """A request's prompt blocks, in order, the first `num_hits_above` found in the tiers
        above: a store with a replacement policy counts it; one without ignores it."""
        ...

    @abstractmethod
    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None: ...

    @abstractmethod
    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None: ...

    def submit_reads(self, reads: Sequence[tuple[BlockRef, torch.Tensor]]) -> list[int]:
        """Start the reads in order, as `submit_read` each, and stop at the first miss: the job
        ids of the leading reads that started, one each (fewer than `reads`: the next one is
        not stored, and none after it was started)."""
        jobs = []
        for ref, dst in reads:
            job = self.submit_read(ref, dst)
            if job is None:
                break
            jobs.append(job)
        return jobs

    def take_lost(self) -> LostBlocks:
        """The blocks the store held and lost since the last call, not by its policy's choice:
        found damaged or gone, or all of them (a lost file, a flushed server). This default is
        for a store that never loses a block; one that can overrides it (a `LossLog`)."""
        return LostBlocks()

    @abstractmethod
    def poll(self) -> list[tuple[int, bool]]: ...

    @abstractmethod
    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]: ...

    @abstractmethod
    def stats(self) -> dict[str, int | str | bool]: ...

    @abstractmethod
    def close(self) -> None: ...
