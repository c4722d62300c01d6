"""Replacement policies that choose their victims: ARC and adaptive W-TinyLFU, over block hashes.

The rules of `replacement.py` keep the tier's LRU order and only answer whether an offered block
takes the LRU victim's place. The policies here own the eviction order: each holds the tier's
resident blocks in its own lists and names the block that leaves. Pure bookkeeping (no KV, no
I/O), replayed offline by `cache/trace.py`; the engine's tiers do not use them yet.

`ARC` (Megiddo & Modha, FAST 2003): the resident blocks not hit since they were offered (`T1`)
and those hit since (`T2`), each in LRU order, and the hashes lately evicted from each (ghosts
`B1`, `B2`, up to twice the capacity in all). A request that misses on a `B1` ghost raises
`T1`'s target size `p` (a longer recency list would have served it), one that misses on a `B2`
ghost lowers it; a full tier evicts `T1`'s LRU block while `T1` is above `p`, else `T2`'s. A
block asked for as a ghost enters `T2` when it is offered again.

`WTinyLFU` (Caffeine; Einziger et al., "Adaptive Software Cache Management", Middleware 2018):
an offered block enters a small LRU window; the window's LRU block then competes for the main
region (segmented LRU: probation, and protected, `PROTECTED_SHARE` of it, for blocks hit in
probation) against main's victim (probation's LRU block) and gets in only if it was requested
more often lately (`FrequencyAdmission`'s counts); the loser leaves. The window's share of the
tier is hill-climbed on the tier's own hit rate: after each sample of `SAMPLE_PER_BLOCK` x
capacity requested blocks it moves one step the way that last helped (the other way when the
hit rate fell), and the step decays. A window of the whole tier is LRU; an empty one, TinyLFU
admission in front of a segmented LRU.

Both count hits as `GhostTier` does: a request's leading resident blocks, touched tail first so
that the head of a chain is the last of them to be evicted; an offered block already resident is
touched (not a hit).

Operations (`Replacement`): `record(hashes)` (a request: every block asked of the tier),
`touch(hash)` (a resident block was read: a hit), `offer(hash)` (returns the block that left:
a victim, the offered block itself if turned away, or None), `remove(hash)` (the tier dropped a
block for a reason of its own), `hash in policy`; `request(policy, hashes)` serves a request as
the replay counts it; `make_replacement(name, capacity)`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal, Protocol, get_args

from tieredkv.replacement import FrequencyAdmission, leading_run

EvictingPolicy = Literal["arc", "wtinylfu"]

PROTECTED_SHARE = 0.8  # of W-TinyLFU's main region: Caffeine's
INITIAL_WINDOW_SHARE = 0.01  # Caffeine's
WINDOW_STEP = 0.0625  # the first hill-climbing step, a share of the tier: Caffeine's
STEP_DECAY = 0.98  # each step is this much of the one before: Caffeine's
SAMPLE_PER_BLOCK = 10  # requested blocks per tier block in a hill-climbing sample: Caffeine's


class Replacement(Protocol):
    def __contains__(self, block_hash: object) -> bool:
        """Whether `block_hash` is resident."""

    def record(self, block_hashes: Sequence[int]) -> None:
        """A request asked the tier for `block_hashes` (hits and misses), before any is touched."""

    def touch(self, block_hash: int) -> None:
        """The resident `block_hash` was read (a hit)."""

    def offer(self, block_hash: int) -> int | None:
        """The tier above let `block_hash` go. Returns the block that left the tier (a victim,
        or `block_hash` itself if it was turned away), None if none did."""

    def remove(self, block_hash: int) -> None:
        """The tier dropped `block_hash` (resident or not) for a reason of its own."""


def request(policy: Replacement, block_hashes: Sequence[int]) -> int:
    """Record a request and touch its leading resident blocks, tail first; returns their number."""
    policy.record(block_hashes)
    run = leading_run(block_hashes, policy)
    for block_hash in reversed(block_hashes[:run]):
        policy.touch(block_hash)
    return run


class ARC:
    """Adaptive Replacement Cache over block hashes (module docstring)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.recent_target = 0.0  # p: the size T1 is kept at, in blocks
        self.recent: OrderedDict[int, None] = OrderedDict()  # T1, the least recently used first
        self.frequent: OrderedDict[int, None] = OrderedDict()  # T2
        self.recent_ghosts: OrderedDict[int, None] = OrderedDict()  # B1
        self.frequent_ghosts: OrderedDict[int, None] = OrderedDict()  # B2
        self._returning: OrderedDict[int, bool] = OrderedDict()  # asked for as a ghost -> of B2

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.recent or block_hash in self.frequent

    def record(self, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            b1, b2 = len(self.recent_ghosts), len(self.frequent_ghosts)
            if block_hash in self.recent_ghosts:
                self.recent_target = min(float(self.capacity), self.recent_target + max(1.0, b2 / b1))
                del self.recent_ghosts[block_hash]
                self._returning[block_hash] = False
            elif block_hash in self.frequent_ghosts:
                self.recent_target = max(0.0, self.recent_target - max(1.0, b1 / b2))
                del self.frequent_ghosts[block_hash]
                self._returning[block_hash] = True
        while len(self._returning) > self.capacity:
            self._returning.popitem(last=False)

    def touch(self, block_hash: int) -> None:
        self.recent.pop(block_hash, None)
        self.frequent[block_hash] = None
        self.frequent.move_to_end(block_hash)

    def offer(self, block_hash: int) -> int | None:
        if block_hash in self:
            self.touch(block_hash)
            return None
        if not self.capacity:
            return block_hash
        from_frequent = self._returning.pop(block_hash, None)
        self.recent_ghosts.pop(block_hash, None)  # a ghost offered again before it was asked for
        self.frequent_ghosts.pop(block_hash, None)
        full = len(self.recent) + len(self.frequent) >= self.capacity
        left = self._replace(from_frequent is True) if full else None
        (self.recent if from_frequent is None else self.frequent)[block_hash] = None
        self._trim_ghosts()
        return left

    def remove(self, block_hash: int) -> None:
        self.recent.pop(block_hash, None)
        self.frequent.pop(block_hash, None)

    def _replace(self, asked_as_frequent_ghost: bool) -> int:
        """Evict T1's LRU block into B1 while T1 is above its target, else T2's into B2."""
        t1 = len(self.recent)
        over = t1 > self.recent_target or (asked_as_frequent_ghost and t1 >= self.recent_target)
        if self.recent and (over or not self.frequent):
            victim = self.recent.popitem(last=False)[0]
            self.recent_ghosts[victim] = None
        else:
            victim = self.frequent.popitem(last=False)[0]
            self.frequent_ghosts[victim] = None
        return victim

    def _trim_ghosts(self) -> None:
        """|T1| + |B1| <= capacity, and all four lists <= 2 x capacity (the oldest ghosts go)."""
        while len(self.recent) + len(self.recent_ghosts) > self.capacity:
            self.recent_ghosts.popitem(last=False)
        lists = (self.recent, self.frequent, self.recent_ghosts, self.frequent_ghosts)
        while sum(map(len, lists)) > 2 * self.capacity:
            self.frequent_ghosts.popitem(last=False)


class WTinyLFU:
    """A window LRU in front of a frequency-filtered segmented LRU, the window's share
    hill-climbed on the hit rate (module docstring)."""

    def __init__(self, capacity_blocks: int, window_share: float = INITIAL_WINDOW_SHARE) -> None:
        self.capacity = capacity_blocks
        self.frequency = FrequencyAdmission(capacity_blocks)
        self.window_share = window_share
        self.window: OrderedDict[int, None] = OrderedDict()  # the least recently used first
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self._period = max(1, SAMPLE_PER_BLOCK * capacity_blocks)
        self._step = WINDOW_STEP  # signed: + grows the window
        self._sample = [0, 0]  # (requested, hit) blocks since the last step
        self._last_rate: float | None = None

    @property
    def window_blocks(self) -> int:
        return round(self.capacity * self.window_share)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.window or block_hash in self.probation or block_hash in self.protected

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)

    def record(self, block_hashes: Sequence[int]) -> None:
        if self._sample[0] >= self._period:
            self._climb()
        self.frequency.record(block_hashes)
        self._sample[0] += len(block_hashes)

    def touch(self, block_hash: int) -> None:
        self._sample[1] += 1
        self._access(block_hash)

    def offer(self, block_hash: int) -> int | None:
        if block_hash in self:
            self._access(block_hash)
            return None
        if not self.capacity:
            return block_hash
        self.window[block_hash] = None
        if len(self.window) <= self.window_blocks:
            return self._evict_main() if len(self) > self.capacity else None
        candidate = self.window.popitem(last=False)[0]
        victim = next(iter(self.probation or self.protected), None)
        if len(self) < self.capacity or victim is None:
            self.probation[candidate] = None
            return self._evict_main() if len(self) > self.capacity else None
        if not self.frequency.admits(candidate, victim):
            return candidate
        self.remove(victim)
        self.probation[candidate] = None
        return victim

    def remove(self, block_hash: int) -> None:
        for region in (self.window, self.probation, self.protected):
            region.pop(block_hash, None)

    def _access(self, block_hash: int) -> None:
        """A resident block used: the most recent of its region; from probation, into protected."""
        if block_hash in self.probation:
            del self.probation[block_hash]
            self.protected[block_hash] = None
            self._rebalance()
        for region in (self.window, self.protected):
            if block_hash in region:
                region.move_to_end(block_hash)

    def _evict_main(self) -> int:
        """Evict main's LRU block (the window's when main is empty)."""
        region = self.probation or self.protected or self.window
        return region.popitem(last=False)[0]

    def _climb(self) -> None:
        """One hill-climbing step on the last sample's hit rate (module docstring)."""
        requested, hits = self._sample
        rate = hits / requested
        if self._last_rate is not None and rate < self._last_rate:
            self._step = -self._step
        self.window_share = min(1.0, max(0.0, self.window_share + self._step))
        self._step *= STEP_DECAY
        self._last_rate, self._sample = rate, [0, 0]
        self._rebalance()

    def _rebalance(self) -> None:
        """Regions back within their shares: the window's LRU blocks move to probation, or main's
        to the window; protected's LRU blocks move down to probation."""
        while len(self.window) > self.window_blocks:
            self.probation[self.window.popitem(last=False)[0]] = None
        main_blocks = self.capacity - self.window_blocks
        while len(self.probation) + len(self.protected) > main_blocks:
            self.window[(self.probation or self.protected).popitem(last=False)[0]] = None
        while len(self.protected) > int(PROTECTED_SHARE * main_blocks):
            self.probation[self.protected.popitem(last=False)[0]] = None


def make_replacement(policy: EvictingPolicy, capacity_blocks: int) -> ARC | WTinyLFU:
    """The policy named `policy` for a tier of `capacity_blocks` blocks."""
    if policy == "arc":
        return ARC(capacity_blocks)
    if policy == "wtinylfu":
        return WTinyLFU(capacity_blocks)
    raise ValueError(f"replacement policy {policy!r}: expected one of {', '.join(get_args(EvictingPolicy))}")
