"""The CPU tier's block trace, and its replay under other policies, offline.

A trace records what was asked of the CPU tier while the engine ran:
- `offer(hash)`: the GPU evicted a cached block; the CPU tier may keep it;
- `request(hashes)`: a request was admitted; its prompt blocks past its GPU hits, in order,
  were looked for in the CPU tier.

`replay(trace, capacity, policy)` runs the same trace through a CPU tier of `capacity` blocks
under `lru`, `tinylfu`, `adaptive` (the engine's rules, `replacement.py`), `arc`, `wtinylfu`
(policies that choose their own victims, `replacement_policies.py`; not in the engine) or `belady`
(on each offer to a full tier, drop whichever of the resident blocks and the offered one is
requested again furthest in the future: Belady's MIN with bypass, the best any policy can do
for blocks taken one by one). A request's hits are counted as in the engine, its leading
resident blocks up to the first miss, and also block by block (`resident_rate`: the measure
under which Belady's is optimal; a prefix-run count may favour another policy). Swapped-out
sequences are not in the trace: replay gives the whole capacity to prefixes.

`simulate(requests, gpu_blocks)` derives a trace with no model: a GPU tier of `gpu_blocks`
cached blocks in LRU order serves each request's leading blocks, asks the CPU tier for the
rest, and offers the blocks it evicts (the tail of a chain before its head, as the engine
frees a sequence's blocks). Running requests hold no blocks: each completes before the next.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from typing import Literal, NamedTuple

from tieredkv.replacement import GhostTier, leading_run, make_admission
from tieredkv.replacement_policies import EvictingPolicy, Replacement, make_replacement, request

ReplayPolicy = Literal["lru", "tinylfu", "adaptive", "arc", "wtinylfu", "belady"]
REPLAY_POLICIES: tuple[ReplayPolicy, ...] = ("lru", "tinylfu", "adaptive", "arc", "wtinylfu", "belady")
EVICTING: tuple[EvictingPolicy, ...] = ("arc", "wtinylfu")


class BlockTrace:
    """Offers and requests, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[int | tuple[int, ...]] = []  # an int is an offer, a tuple a request

    def offer(self, block_hash: int) -> None:
        self.events.append(block_hash)

    def request(self, block_hashes: tuple[int, ...]) -> None:
        if block_hashes:
            self.events.append(block_hashes)


class ReplayResult(NamedTuple):
    requested_blocks: int
    hit_blocks: int  # leading resident blocks of each request, as the engine counts hits
    resident_blocks: int  # requested blocks resident, each counted alone (Belady's is the most)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.requested_blocks if self.requested_blocks else 0.0

    @property
    def resident_rate(self) -> float:
        return self.resident_blocks / self.requested_blocks if self.requested_blocks else 0.0


def replay(trace: BlockTrace, capacity: int, policy: ReplayPolicy) -> ReplayResult:
    """The trace through a tier of `capacity` blocks under `policy` (module docstring)."""
    if policy == "belady":
        return _replay_belady(trace.events, capacity)
    if policy == "arc" or policy == "wtinylfu":
        return _replay_evicting(trace.events, make_replacement(policy, capacity))
    admission = make_admission(policy, capacity)
    tier = GhostTier(capacity)
    requested = hits = alone = 0
    for event in trace.events:
        if isinstance(event, tuple):
            admission.record(event)
            requested += len(event)
            alone += sum(block_hash in tier.resident for block_hash in event)
            hits += tier.request(event)
        else:
            admission.offered(event)
            tier.offer(event, admission.admits)
    return ReplayResult(requested, hits, alone)


def _replay_evicting(events: list[int | tuple[int, ...]], policy: Replacement) -> ReplayResult:
    requested = hits = alone = 0
    for event in events:
        if isinstance(event, tuple):
            requested += len(event)
            alone += sum(block_hash in policy for block_hash in event)
            hits += request(policy, event)
        else:
            policy.offer(event)
    return ReplayResult(requested, hits, alone)


def _replay_belady(events: list[int | tuple[int, ...]], capacity: int) -> ReplayResult:
    uses: defaultdict[int, list[int]] = defaultdict(list)  # hash -> the events requesting it
    for t, event in enumerate(events):
        if isinstance(event, tuple):
            for block_hash in event:
                uses[block_hash].append(t)
    never = len(events)

    def next_use(block_hash: int, t: int) -> int:
        times = uses.get(block_hash, ())
        i = bisect.bisect_right(times, t)
        return times[i] if i < len(times) else never

    resident: dict[int, int] = {}  # hash -> its next use
    furthest: list[tuple[int, int]] = []  # (-next use, hash), stale entries skipped
    requested = hits = alone = 0

    def keep(block_hash: int, t: int) -> None:
        resident[block_hash] = when = next_use(block_hash, t)
        heapq.heappush(furthest, (-when, block_hash))

    for t, event in enumerate(events):
        if isinstance(event, tuple):
            requested += len(event)
            hits += leading_run(event, resident)
            alone += sum(block_hash in resident for block_hash in event)
            for block_hash in event:  # requested now: each resident one's next use moves on
                if block_hash in resident:
                    keep(block_hash, t)
        elif event in resident or capacity == 0:
            continue
        elif len(resident) < capacity:
            keep(event, t)
        else:
            while -furthest[0][0] != resident.get(furthest[0][1]):
                heapq.heappop(furthest)
            if next_use(event, t) < -furthest[0][0]:
                del resident[heapq.heappop(furthest)[1]]
                keep(event, t)
    return ReplayResult(requested, hits, alone)


def replay_all(trace: BlockTrace, capacity: int) -> dict[str, object]:
    """The trace's hit rate at `capacity` blocks under every replay policy."""
    results = {policy: replay(trace, capacity, policy) for policy in REPLAY_POLICIES}
    return {
        "capacity_blocks": capacity,
        "requested_blocks": results["lru"].requested_blocks,
        "hit_rate": {policy: result.hit_rate for policy, result in results.items()},
        "resident_rate": {policy: result.resident_rate for policy, result in results.items()},
    }


def simulate(requests: Iterable[tuple[tuple[int, ...], tuple[int, ...]]], gpu_blocks: int) -> BlockTrace:
    """The CPU tier's trace under a GPU tier of `gpu_blocks` (module docstring). Each request is
    (its prompt's full blocks, the blocks it leaves cached: the prompt's and its answer's)."""
    trace = BlockTrace()
    gpu: OrderedDict[int, None] = OrderedDict()  # cached blocks, the least recently used first
    for prompt, cached in requests:
        trace.request(prompt[leading_run(prompt, gpu):])
        for block_hash in reversed(cached):  # the head touched last: the tail is evicted first
            gpu[block_hash] = None
            gpu.move_to_end(block_hash)
        while len(gpu) > gpu_blocks:
            trace.offer(gpu.popitem(last=False)[0])
    return trace
