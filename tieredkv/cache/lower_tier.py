"""The lower tier: everything below the CPU tier (a disk store, a remote one, or both as one
`BlockStore`), as the rest of the engine sees it. It owns the lower tier's loads and spills,
and every request's load state; the KV manager asks it questions and never names a medium.

Operations:
- `held_run(hashes, start) -> stop`: how far from block `start` on the tier holds a prompt's blocks;
  `requested(hashes, num_hits_above)`: an admitted request's blocks, for the store's policy.
- loads, one plan per request: `plan(request_id, refs, load_from, hits)` reads `refs` into CPU blocks
  held for the request (its reads go to the store in one `submit_reads`); `load_from(request_id)`
  (the first token being read), `num_planned`, `arriving`, `wait_state` (`LoadWait`), `admitted`
  (its CPU hits are its own now; the loaded blocks stay held until it reaches them), `landed` (the
  sequence jumps over the loaded blocks), `forget` (the sequence was freed); `read_ahead(request_id,
  refs)`: once its loads landed, read the blocks before them too (the tier idle); `landed_loads()`: how
  long the loads that landed took, from submission; `late(request_id)` (a waiting request's
  reads still in flight, and the queue up to its last one), `give_up(request_id)` (it stops
  waiting for them and computes those tokens);
- spills (`cache/spill.py`, `Spill`), for the CPU tier: `stage()`, `write_staged(block, ref)`,
  `unstage(block)`; `retire()` books finished reads and writes and spills ahead; `close()`
  first writes the CPU tier's cached blocks down (`persist`);
- `make_room(n)`: CPU blocks for a swap-out the CPU tier has no other room for (`swap_room`):
  the spill's idle staging blocks first (`Spill.lend`, taken back later), then the blocks held
  for requests not admitted yet (their hits, and the blocks their loads brought), newest plan
  first: a swapped sequence comes back for certain, a load only maybe. A request whose plan is
  dropped so is planned again, from what the tiers hold then (`plans_dropped`).

Reads come first: while any is in flight, no write is submitted (`Spill.behind`): spills are
dropped or wait in CPU staging blocks, never queued on the disk.
A read given up (its request computes those tokens instead) stays the store's until it reports:
its CPU block stays taken until then, and is cached if the read was intact. A request gives up
its reads when computing them is faster than waiting (`give_up`, the planner's choice), and a
read not finished `STALLED_READ_S` after it was submitted (a disk that hangs) is given up for
it; until a stalled read reports, the tier is held to have no block (`held_run`), so that a hung
disk costs later requests nothing (said when it starts and when it ends).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.spill import Spill
from tieredkv.replacement import AdaptiveAdmission, AdmitAll, FrequencyAdmission
from tieredkv.tiers.backend import BlockRef, BlockStore

logger = logging.getLogger(__name__)

# held_run asks the tier about this many blocks first, then twice as many each time
FIRST_LOOKUP_BLOCKS = 64
MAX_LOOKUP_BLOCKS = 1024
# a read in flight this long is given up for its request (its tokens are computed instead)
STALLED_READ_S = 10.0


class _Read(NamedTuple):
    """A read in flight: the request it is for, the CPU block it fills, the block, and when it
    was submitted."""

    request_id: str
    block: Block
    ref: BlockRef
    submitted: float


class LoadWait(Enum):
    """Where a sequence found with nothing to compute before its loads land stands."""

    NONE = "none"  # it waits for no load
    ARRIVING = "arriving"  # its loads are still in flight
    LANDED = "landed"  # they landed since it was last asked about (told once)


class _Plan(NamedTuple):
    """A request's loads: `num_blocks` prefix blocks from token `load_from` on, of which the first
    `num_reading` were submitted last (their reads land in order; those after them landed)."""

    load_from: int
    num_blocks: int
    num_reading: int


class LateReads(NamedTuple):
    """A request waiting for its reads: of the blocks its plan loads from token `load_from`
    on, the first `num_landed` are in, the next `num_blocks` in flight; `queued` reads are in
    flight up to its last one (its own included)."""

    load_from: int
    num_landed: int
    num_blocks: int
    queued: int


class LandedLoad(NamedTuple):
    """A request's loads landed: `num_blocks` read (with those queued ahead of them), `seconds`
    from their submission to the step that found them landed."""

    request_id: str
    num_blocks: int
    seconds: float


class LowerTier:
    """Loads from and spills to `store`, through CPU blocks of `cpu_pool` (`cpu_blocks[i]`: block
    i's data, as the store takes it)."""

    def __init__(
        self, store: BlockStore, cpu_pool: BlockPool, cpu_blocks: Sequence,
        admission: AdmitAll | FrequencyAdmission | AdaptiveAdmission,
    ) -> None:
        self.store = store
        self.cpu_pool = cpu_pool
        self.cpu_blocks = cpu_blocks
        self.admission = admission
        self.spill = Spill(store, cpu_pool, self.cpu_blocks)
        # request -> its loads (maybe none); a request is here once its loads were planned, until
        # it jumps over them or is freed
        self._load_from: dict[str, _Plan] = {}
        self._loads: dict[str, list[Block]] = {}  # request -> CPU blocks read (or being read) for it
        self._hits: dict[str, list[Block]] = {}  # request -> its CPU hits, held until it is admitted
        self._admitted: set[str] = set()  # requests admitted with their plan (it is theirs until it lands)
        self._reads: dict[int, _Read] = {}  # read job -> what it fills, in submission order
        self._reads_left: dict[str, int] = {}  # request -> its reads in flight
        self._orphans: set[int] = set()  # reads whose request let go of them before they finished
        self._given_up: set[int] = set()  # reads their request no longer waits for
        self._ends: dict[str, int] | None = None  # `_queue_ends`, until the queue changes
        self._stalled: set[int] = set()  # reads given up as stalled: while any is out, the tier holds none
        # requests found with nothing to compute before their loads land: not matched again
        # (O(prompt) each step, which starved the I/O threads of the GIL) until they have
        self._waiting: set[str] = set()
        self._clocks: dict[str, tuple[float, int]] = {}  # request -> (submitted at, blocks read until landed)
        self._landed: list[LandedLoad] = []
        self.loaded_blocks = 0
        self.failed_loads = 0
        self.stalled_loads = 0
        self.late_loads = 0  # reads given up because computing their blocks was faster
        self.plans_dropped = 0  # plans of requests not admitted yet, dropped to make room for a swap-out

    # ------------------------------------------------------------------ lookups

    def contains(self, block_hash: int) -> bool:
        return self.store.contains(block_hash)

    def held_run(self, block_hashes: Sequence[int], start: int) -> int:
        """The end of the run of `block_hashes` from `start` on that the tier holds. It is asked
        about windows of blocks, the first `FIRST_LOOKUP_BLOCKS` long, each next one twice the
        last (up to `MAX_LOOKUP_BLOCKS`), until one is not held to its end: a long prompt the
        tier lacks costs one small question (for a remote tier, one round trip). While a read
        given up as stalled is still out (the tier hangs), it holds none: no load is planned on
        it, and no CPU block is taken for a read that may not come back."""
        if self._stalled:
            return start
        stop, size = start, FIRST_LOOKUP_BLOCKS
        while stop < len(block_hashes):
            window = block_hashes[stop : stop + size]
            held = self.store.contains_run(window)
            stop += held
            if held < len(window):
                break
            size = min(2 * size, MAX_LOOKUP_BLOCKS)
        return stop

    def requested(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        """A request was admitted asking for these prompt blocks, the first `num_hits_above`
        found in the GPU and CPU tiers: the store's replacement policy counts it."""
        self.store.record(block_hashes, num_hits_above)

    # ------------------------------------------------------------------ loads

    def planned(self, request_id: str) -> bool:
        """Whether the request's loads were planned (until it jumps over them or is freed)."""
        return request_id in self._load_from

    def plan(self, request_id: str, refs: Sequence[BlockRef], load_from: int, hits: Sequence[Block] = ()) -> int:
        """Plan the request's loads: read `refs` (its prefix blocks from token `load_from` on)
        into CPU blocks held for it; a block the CPU tier holds already (past a gap in the run
        the match found) is held, not read. While it waits for them, its CPU-tier `hits` (the
        blocks before `load_from`) are held too: loads, its own or others', take CPU blocks and
        would otherwise evict them. How many blocks the plan brings (none: nothing is loaded,
        nothing held)."""
        queued = len(self._reads)
        for block in hits:  # before its own reads take CPU blocks
            self.cpu_pool.touch(block)
        brought = self._start(request_id, refs) if refs else 0
        self._load_from[request_id] = _Plan(load_from, brought, brought)
        if brought:
            self._hits[request_id] = list(hits)
        else:
            self.cpu_pool.release(hits)
        self._start_clock(request_id, queued)
        return brought

    def read_ahead(self, request_id: str, refs: Sequence[BlockRef], hits: Sequence[Block] = ()) -> int:
        """Read `refs` too: the prefix blocks just before those the request's plan loads (all
        landed), which it was to compute. Only the last of them that fit in half of the CPU
        tier's free blocks (the rest stays for others' loads and swaps), so that what it loads
        stays one run; how many it brings (0: none, as when the store lost one since it was
        asked: the run would break there). Its CPU-tier `hits` are held from then on, as for a plan."""
        planned = self._load_from[request_id]
        assert not self.arriving(request_id), "read ahead only once the loads landed"
        refs = refs[max(0, len(refs) - self.cpu_pool.num_free // 2):]
        if not refs:
            return 0
        if request_id not in self._hits:
            for block in hits:
                self.cpu_pool.touch(block)
            self._hits[request_id] = list(hits)
        queued = len(self._reads)
        brought = self._start(request_id, refs)
        if brought < len(refs):  # the blocks it read would not reach its plan's: let them land unheld
            self._stop_waiting_for(request_id)
            return 0
        block_size = len(refs[0].token_ids)  # a ref holds one block's tokens
        self._load_from[request_id] = _Plan(planned.load_from - brought * block_size,
                                            planned.num_blocks + brought, brought)
        self._start_clock(request_id, queued)
        return brought

    def _start_clock(self, request_id: str, queued: int) -> None:
        """Time the request's reads just submitted, behind `queued` others, until they land."""
        if self.arriving(request_id):
            self._clocks[request_id] = (time.monotonic(), queued + self._reads_left[request_id])

    def _start(self, request_id: str, refs: Sequence[BlockRef]) -> int:
        """Hold or read `refs` for the request, in order, up to the first that can be neither
        (no CPU block free, or evicted from the store since the lookup); how many. The reads
        go to the store in one `submit_reads`, which stops at the first miss: the CPU blocks
        taken from that one on are let go again (a block an earlier read still fills stays that
        read's, released when it lands)."""
        let_go = self._let_go(request_id)
        taken = self._take(refs, let_go)
        filling = {self._reads[job].block.block_id: job for job in let_go.values()}  # block -> its read
        reads = [(ref, block) for block, ref in taken if ref is not None]
        jobs = self.store.submit_reads([(ref, self.cpu_blocks[b.block_id]) for ref, b in reads]) if reads else []
        if len(jobs) < len(reads):  # reads[len(jobs)] missed: it and every block after it are let go
            missed = reads[len(jobs)][1]
            stop = next(i for i, (block, _) in enumerate(taken) if block is missed)
            self.cpu_pool.release(block for block, _ in taken[stop:] if block.block_id not in filling)
            del taken[stop:], reads[len(jobs):]
        if filling:  # the reads let go of whose blocks it kept are its own again
            self._orphans.difference_update(filling[b.block_id] for b, _ in taken if b.block_id in filling)
        submitted, self._ends = time.monotonic(), None
        for job, (ref, block) in zip(jobs, reads, strict=True):
            self._reads[job] = _Read(request_id, block, ref, submitted)
        self._loads.setdefault(request_id, []).extend(block for block, _ in taken)
        if jobs:
            self._reads_left[request_id] = self._reads_left.get(request_id, 0) + len(jobs)
        return len(taken)

    def _let_go(self, request_id: str) -> dict[int, int]:
        """The request's reads in flight whose blocks it let go of (freed while they were out)
        and still waits for, by block hash: their jobs."""
        if not self._orphans:
            return {}
        return {read.ref.block_hash: job for job, read in self._reads_of(request_id).items()
                if job in self._orphans and job not in self._given_up}

    def _take(self, refs: Sequence[BlockRef], let_go: dict[int, int]) -> list[tuple[Block, BlockRef | None]]:
        """A CPU block for each of `refs`, in order, up to the first with none free: the one a
        read the request let go of still fills (`let_go`: hash -> job; held again by the caller
        if kept), the one the CPU tier holds already (touched), neither with a ref (nothing to
        read), else a new one with the ref to read into it."""
        taken: list[tuple[Block, BlockRef | None]] = []
        for ref in refs:
            job = let_go.get(ref.block_hash)
            if job is not None:
                taken.append((self._reads[job].block, None))
                continue
            cached = self.cpu_pool.lookup(ref.block_hash, ref.parent_hash, ref.token_ids)
            if cached is not None:
                self.cpu_pool.touch(cached)
                taken.append((cached, None))
                continue
            new = self.cpu_pool.allocate(1)
            if new is None:
                break
            taken.append((new[0], ref))
        return taken

    def load_from(self, request_id: str) -> int | None:
        """The first token of the request's prefix blocks being loaded (None: none)."""
        planned = self._load_from.get(request_id)
        return planned.load_from if planned is not None and planned.num_blocks else None

    def ahead_of_loads(self, request_id: str) -> int | None:
        """The token a read-ahead reads up to: the first of the blocks the request's plan loads,
        or where they would have started when it loads none (None: not planned)."""
        planned = self._load_from.get(request_id)
        return planned.load_from if planned is not None else None

    def num_planned(self, request_id: str) -> int:
        """Prefix blocks the request's plan reads from `load_from` on (0 once it jumped over
        them, or with no plan)."""
        planned = self._load_from.get(request_id)
        return planned.num_blocks if planned is not None else 0

    def arriving(self, request_id: str) -> bool:
        """Whether reads for the request are in flight."""
        return self._reads_left.get(request_id, 0) > 0

    def await_loads(self, request_id: str) -> None:
        """The request has nothing to compute before its loads land (`wait_state` tells when)."""
        self._waiting.add(request_id)

    def wait_state(self, request_id: str) -> LoadWait:
        """Whether a request that had nothing to compute before its loads land still waits."""
        if request_id not in self._waiting:
            return LoadWait.NONE
        if self.arriving(request_id):
            return LoadWait.ARRIVING
        self._waiting.discard(request_id)
        return LoadWait.LANDED

    @property
    def reads_in_flight(self) -> int:
        """Block reads submitted and not finished: the tier's queue."""
        return len(self._reads)

    def admitted(self, request_id: str) -> None:
        """The request was admitted: its CPU hits are its own now (copied in, or recomputed).
        The blocks its loads bring stay held until it reaches them (`landed`): released now,
        they were evicted before it did."""
        self.cpu_pool.release(self._hits.pop(request_id, []))
        if request_id in self._load_from:
            self._admitted.add(request_id)

    def _release(self, request_id: str) -> None:
        """Drop the request's hold on its CPU hits and loaded blocks (they stay cached in the CPU tier)."""
        self.cpu_pool.release(self._hits.pop(request_id, []))
        self._admitted.discard(request_id)
        held = self._loads.pop(request_id, [])
        if not self.arriving(request_id):  # the common case (its loads landed, or it never had any)
            self.cpu_pool.release(held)
            return
        in_flight = {id(read.block): job for job, read in self._reads_of(request_id).items()}
        for block in held:
            job = in_flight.get(id(block))
            if job is None:
                self.cpu_pool.release([block])
            else:  # its read still writes into it: release when the read is reported
                self._orphans.add(job)

    def landed(self, request_id: str) -> None:
        """The sequence jumped over its loaded blocks (or found none intact): its plan is done."""
        del self._load_from[request_id]
        self._waiting.discard(request_id)
        self._release(request_id)

    def forget(self, request_id: str) -> None:
        """The request was freed: forget its plan; its reads in flight still finish (planned
        again before they land, it waits for them too: they bring blocks it asks for, and its
        new plan holds those again instead of reading them twice)."""
        self._load_from.pop(request_id, None)
        self._waiting.discard(request_id)
        self._clocks.pop(request_id, None)
        self._release(request_id)

    def landed_loads(self) -> list[LandedLoad]:
        """The requests whose loads landed since the last call, and how long they took."""
        landed, self._landed = self._landed, []
        return landed

    def _finish_read(self, job: int, ok: bool) -> None:
        request_id, block, ref, _ = self._reads.pop(job)
        self._ends = None
        if job in self._stalled:
            self._stalled.discard(job)
            if not self._stalled:
                logger.info("the stalled reads from the tier below the CPU tier came back; loads are planned again")
        if job in self._given_up:
            self._given_up.discard(job)
        else:
            self._read_done(request_id)
        if ok:
            self.cpu_pool.cache(block, ref.block_hash, ref.parent_hash, ref.token_ids)
            # read back for one request, it does not displace what admission chose to keep (it
            # is in the tier below); it stays at the eviction end until admission keeps a demotion of it
            block.evict_first = self.admission.selective
            self.loaded_blocks += 1
        else:
            self.failed_loads += 1
        if job in self._orphans:
            self._orphans.discard(job)
            self.cpu_pool.release([block])

    def _read_done(self, request_id: str) -> None:
        """One read fewer for the request to wait for; the last one stops its clock."""
        self._reads_left[request_id] -= 1
        if not self._reads_left[request_id]:
            del self._reads_left[request_id]
            self._stop_clock(request_id)

    def _give_up_stalled(self) -> None:
        """Stop waiting for the reads submitted `STALLED_READ_S` ago or more: their requests
        compute those tokens; each block is released when the store reports its read."""
        too_old = time.monotonic() - STALLED_READ_S
        for job, read in self._reads.items():
            if read.submitted > too_old:
                break  # in submission order: the rest are younger
            if job in self._stalled:
                continue
            if not self._stalled:
                logger.warning("a read from the tier below the CPU tier did not finish in %.0f s: its request computes "
                               "those tokens, and no load is planned until the stalled reads come back", STALLED_READ_S)
            self._stalled.add(job)
            if job not in self._given_up:
                self.stalled_loads += 1
                self._stop_waiting(job, read)

    def _stop_waiting(self, job: int, read: _Read) -> None:
        """The read's request no longer waits for it: its block is let go when the read reports."""
        self._given_up.add(job)
        self._ends = None
        held = self._loads.get(read.request_id)
        if held is not None and read.block in held:
            held.remove(read.block)
            self._orphans.add(job)
        self._read_done(read.request_id)

    def late(self, request_id: str) -> LateReads | None:
        """The request's reads still in flight, if it waits for some (found with nothing to
        compute before they land): how many, from which token on (those before them landed,
        in the order they were submitted), and the reads queued up to its last one. A request
        freed and planned again still waits for its old reads (`forget`): they may outnumber
        what its new plan reads; then none of the plan's blocks counts as in, and the old reads
        count only in the queue."""
        left = self._reads_left.get(request_id, 0)
        planned = self._load_from.get(request_id)
        if not left or planned is None or request_id not in self._waiting:
            return None
        in_flight = min(left, planned.num_reading)
        return LateReads(planned.load_from, planned.num_reading - in_flight, in_flight, self._queue_ends()[request_id])

    def _queue_ends(self) -> dict[str, int]:
        """Each request's reads in flight up to its last one waited for (in submission order),
        found in one pass over the queue after it changed (each waiting request asks, each step)."""
        if self._ends is None:
            self._ends = {}
            for i, (job, read) in enumerate(self._reads.items(), 1):
                if job not in self._given_up:
                    self._ends[read.request_id] = i
        return self._ends

    def give_up(self, request_id: str) -> None:
        """The request stops waiting for its reads in flight (it computes those tokens; they
        still land in the CPU tier): `wait_state` says it landed, and a running sequence jumps
        over the blocks that did."""
        self._clocks.pop(request_id, None)  # how long its loads take is not seen
        self.late_loads += self._stop_waiting_for(request_id)

    def _stop_waiting_for(self, request_id: str) -> int:
        """The request no longer waits for any of its reads in flight; how many it waited for."""
        stopped = 0
        for job, read in self._reads_of(request_id).items():
            if job not in self._given_up:
                self._stop_waiting(job, read)
                stopped += 1
        return stopped

    def _reads_of(self, request_id: str) -> dict[int, _Read]:
        """The request's reads in flight (given up or not), by job, in submission order."""
        return {job: read for job, read in self._reads.items() if read.request_id == request_id}

    def _stop_clock(self, request_id: str) -> None:
        clock = self._clocks.pop(request_id, None)
        if clock is not None:
            since, num_blocks = clock
            self._landed.append(LandedLoad(request_id, num_blocks, time.monotonic() - since))

    # ------------------------------------------------------------------ spills

    def stage(self) -> Block | None:
        """A staging CPU block for a demotion on its way down (None: dropped, counted)."""
        return self.spill.stage(len(self._reads))

    def write_staged(self, block: Block, ref: BlockRef) -> None:
        """The staging block holds the demoted block now: write it, or drop it if behind."""
        self.spill.write_staged(block, ref, len(self._reads))

    def unstage(self, block: Block) -> None:
        self.spill.unstage(block)

    # ------------------------------------------------------------------ room for swap-outs

    @property
    def swap_room(self) -> int:
        """CPU blocks not free that `make_room` can give a swap-out: idle staging blocks, and
        the blocks only a plan of a request not admitted yet holds (not those still being read)."""
        return self.spill.lendable + sum(map(self._droppable, self._droppable_plans()))

    def make_room(self, n: int) -> None:
        """Free up to `n` CPU blocks for a swap-out: lend idle staging blocks, then drop the
        plans of requests not admitted yet, newest first, until enough are free."""
        n -= self.spill.lend(n)
        for request_id in reversed(self._droppable_plans()):
            if n <= 0:
                return
            freed = self._droppable(request_id)
            if freed:  # a plan that holds nothing is kept: dropping it frees nothing
                n -= freed
                self.plans_dropped += 1
                self.forget(request_id)

    def _droppable_plans(self) -> list[str]:
        """The planned requests not admitted yet, oldest plan first."""
        return [r for r in self._load_from if r not in self._admitted]

    def _droppable(self, request_id: str) -> int:
        """Blocks the request's plan alone holds that dropping it frees now."""
        reading = {id(read.block) for read in self._reads_of(request_id).values()}
        held = self._hits.get(request_id, []) + self._loads.get(request_id, [])
        return sum(1 for b in held if b.ref_count == 1 and id(b) not in reading and not self.cpu_pool.is_pinned(b))

    @property
    def busy(self) -> bool:
        """Whether reads or writes are in flight, or staged copies wait for the disk."""
        return bool(self._reads) or self.spill.backlog > 0

    @property
    def held_blocks(self) -> int:
        """CPU blocks held on their way down (staging, writes in flight), not by requests."""
        return self.spill.held_blocks

    # ------------------------------------------------------------------ steps

    def retire(self) -> int:
        """Book the finished reads (and writes), then spill ahead if no read is in flight; how
        many reads and writes finished."""
        written = self.spill.writes_finished
        reads = self.spill.poll()
        for job, ok in reads:
            self._finish_read(job, ok)
        if self._reads:
            self._give_up_stalled()
        self.spill.spill_ahead(len(self._reads))
        return len(reads) + self.spill.writes_finished - written

    def stats(self) -> dict[str, int | str]:
        """The `nvme_*` counters (they name whatever sits below the CPU tier)."""
        return {
            **self.spill.stats(),
            "nvme_loaded_blocks": self.loaded_blocks,
            "nvme_failed_loads": self.failed_loads,
            "nvme_stalled_loads": self.stalled_loads,
            "nvme_late_loads": self.late_loads,
            "nvme_plans_dropped_for_swaps": self.plans_dropped,
        }

    def close(self) -> None:
        """Write the CPU tier's cached blocks down (so that a restart finds them), then close."""
        self.spill.persist()
        self.store.close()
