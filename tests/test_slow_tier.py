"""A slow tier stays off the critical path: a disk that does not answer never holds back an
engine step, a submit, or a read behind queued writes; and when the disk is behind, spills are
dropped (counted), never queued.

`StuckDisk` is a real backend whose writes block in `submit` until released (a disk whose queue
is full); `BehindStore` a store whose writes never finish until released."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import pytest
import torch

from tests.kv_factory import BLOCK_SHAPE, make_kv, make_scheduler, make_seq, run_until_done
from tests.test_nvme_store import BLOCK_BYTES as STORE_BLOCK_BYTES
from tests.test_nvme_store import (
    BLOCK_SIZE,
    FP,
    CountingBackend,
    cpu_pool,
    fill,
    parent_of,
    same_bytes,
    slots_capacity,
    tokens_of,
)
from tieredkv.cache import spill as spill_module
from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.lower_tier import LoadWait, LowerTier
from tieredkv.cache.manager import KVCacheManager
from tieredkv.cache.offload import CPUOffload
from tieredkv.cache.spill import MIN_WRITES_IN_FLIGHT, Spill, write_bound
from tieredkv.replacement import AdmitAll
from tieredkv.tiers.backend import BlockRef, BlockStore
from tieredkv.tiers.cpu import CPUTier
from tieredkv.tiers.nvme.block_io import IORequest
from tieredkv.tiers.nvme.io_backends import SyncBackend
from tieredkv.tiers.nvme.store import NVMeStore
from tieredkv.transfer.engine import TransferEngine

WAIT_S = 30  # far longer than any step here takes: a step still running then waits for the disk


class StuckDisk(SyncBackend):
    """A sync backend whose write submits block while `stuck` is clear; records the order of
    the requests it was given."""

    def __init__(self) -> None:
        super().__init__(2)
        self.stuck = threading.Event()
        self.stuck.set()  # flowing
        self.order: list[tuple[str, int]] = []

    def submit(self, requests: Sequence[IORequest]) -> None:
        for req in requests:
            self.order.append((req.op, req.tag))
            if req.op == "write":
                self.stuck.wait()
        super().submit(requests)


def in_thread(work, *args) -> threading.Thread:
    thread = threading.Thread(target=work, args=args, daemon=True)
    thread.start()
    return thread


def ref(h: int) -> BlockRef:
    return BlockRef(h, parent_of(h), tuple(tokens_of(h)))


# ------------------------------------------------------------------ the store


def test_a_write_submit_returns_while_the_disk_is_stuck_and_does_no_work_on_the_caller(tmp_path, monkeypatch):
    from tieredkv.tiers.nvme import slot_io

    checksummed_on: set[int] = set()
    real_xxh3 = slot_io.xxhash.xxh3_64_intdigest

    def spy(data):
        checksummed_on.add(threading.get_ident())
        return real_xxh3(data)

    monkeypatch.setattr(slot_io.xxhash, "xxh3_64_intdigest", spy)
    disk = StuckDisk()
    src, dst = cpu_pool(4), cpu_pool(1)
    fill(src, [1, 2, 3, 4])
    with NVMeStore(tmp_path, slots_capacity(8), STORE_BLOCK_BYTES, FP, BLOCK_SIZE, backend=disk) as store:
        disk.stuck.clear()
        checksummed_on.clear()  # (opening the store hashes its fingerprint)
        jobs: list[int] = []
        try:
            submitting = in_thread(lambda: jobs.extend(store.submit_write(ref(h), src[h - 1]) for h in (1, 2, 3, 4)))
            submitting.join(WAIT_S)
            assert not submitting.is_alive() and len(jobs) == 4  # handed over, the disk still stuck
            assert threading.get_ident() not in checksummed_on and submitting.ident not in checksummed_on
        finally:
            disk.stuck.set()
        assert store.wait(jobs) == dict.fromkeys(jobs, True)
        job = store.submit_read(ref(3), dst[0])
        assert store.wait([job]) == {job: True} and same_bytes(dst[0], src[2])


def test_a_read_goes_ahead_of_the_writes_queued_before_it(tmp_path):
    disk = StuckDisk()
    src, dst = cpu_pool(5), cpu_pool(1)
    fill(src, [1, 2, 3, 4, 5])
    with NVMeStore(tmp_path, slots_capacity(8), STORE_BLOCK_BYTES, FP, BLOCK_SIZE, backend=disk,
                   queue_depth=1) as store:
        first = store.submit_write(ref(1), src[0])
        assert store.wait([first]) == {first: True}
        disk.stuck.clear()
        writes: list[int] = []
        try:
            submitting = in_thread(lambda: writes.extend(store.submit_write(ref(h), src[h - 1]) for h in (2, 3, 4, 5)))
            submitting.join(WAIT_S)
            assert not submitting.is_alive()
            while len(disk.order) < 2:  # 2 is at the disk, stuck; 3, 4 and 5 queue behind it
                time.sleep(0.001)
            read = store.submit_read(ref(1), dst[0])
        finally:
            disk.stuck.set()
        assert store.wait([*writes, read]) == dict.fromkeys([*writes, read], True)
    assert disk.order == [("write", first), ("write", writes[0]), ("read", read)] + [("write", j) for j in writes[1:]]


def test_a_load_plan_reaches_the_disk_in_one_submit(tmp_path):
    """The lower tier hands a plan's reads to the store at once, and the store to the disk in
    one backend call (one io_uring_submit), not one a block."""
    hashes = [1, 2, 3, 4, 5, 6]
    src = cpu_pool(6)
    fill(src, hashes)
    disk = CountingBackend(SyncBackend(2))
    with NVMeStore(tmp_path, slots_capacity(8), STORE_BLOCK_BYTES, FP, BLOCK_SIZE, backend=disk) as store:
        jobs = [store.submit_write(ref(h), src[i]) for i, h in enumerate(hashes)]
        assert store.wait(jobs) == dict.fromkeys(jobs, True)
        disk.calls.clear()
        pool, cpu_blocks = BlockPool(16), cpu_pool(16)
        lower = LowerTier(store, pool, cpu_blocks, AdmitAll())
        assert lower.plan("r", [ref(h) for h in hashes], load_from=0) == 6
        assert disk.calls == [["read"] * 6]
        deadline = time.monotonic() + WAIT_S
        while lower.reads_in_flight:
            assert time.monotonic() < deadline, "the reads never finished"
            lower.retire()
            time.sleep(0.001)
        assert lower.loaded_blocks == 6 and lower.failed_loads == 0
        for i, h in enumerate(hashes):
            assert same_bytes(cpu_blocks[pool.lookup(h, parent_of(h), tokens_of(h)).block_id], src[i])


# ------------------------------------------------------------------ the engine loop


def test_engine_steps_run_on_while_the_disk_is_stuck(tmp_path):
    disk = StuckDisk()
    sim = make_kv(4, num_cpu_blocks=16, nvme_path=str(tmp_path), cpu_policy="lru", backend=disk)
    sched = make_scheduler(sim, "recompute")
    disk.stuck.clear()

    def serve() -> None:  # 12 prompts of 2 full blocks through a 4-block GPU tier: CPU and disk busy
        for i in range(12):
            sched.add(make_seq(f"p{i}", [i * 100 + j for j in range(9)], max_tokens=2))
            run_until_done(sched, sim)

    serving = in_thread(serve)
    serving.join(WAIT_S)
    deadline = time.monotonic() + WAIT_S  # the store's I/O thread hands the queued writes to the disk
    while not disk.order and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = sim.kv.stats()
    disk.stuck.set()
    assert not serving.is_alive()  # every step and allocation ran with writes stuck at the disk
    assert stats["nvme_write_backlog"] > 0 and stats["nvme_spilled_blocks"] == 0
    assert disk.order and all(op == "write" for op, _ in disk.order)
    sim.kv.close()


def test_tending_with_no_step_books_what_the_disk_finished_and_writes_on(tmp_path):
    disk = StuckDisk()
    sim = make_kv(4, num_cpu_blocks=16, nvme_path=str(tmp_path), cpu_policy="lru", backend=disk)
    sched = make_scheduler(sim, "recompute")
    disk.stuck.clear()
    for i in range(12):  # as above: writes queue up while the disk is stuck
        sched.add(make_seq(f"p{i}", [i * 100 + j for j in range(9)], max_tokens=2))
        run_until_done(sched, sim)
    before = sim.kv.stats()
    assert not sched.has_unfinished() and before["nvme_write_backlog"] > 0 and before["nvme_spilled_blocks"] == 0
    disk.stuck.set()  # the disk is back; no request comes, no step runs
    deadline = time.monotonic() + WAIT_S
    while sim.kv.tend() is not None:
        assert time.monotonic() < deadline, "the tiers' I/O never settled"
        time.sleep(0.005)
    after = sim.kv.stats()
    assert after["nvme_write_backlog"] == 0 and after["nvme_spilled_blocks"] >= before["nvme_write_backlog"]
    sim.kv.close()


# ------------------------------------------------------------------ dropped, not queued


class BehindStore(BlockStore):
    """A store whose writes finish only when `release()` is called; it holds nothing else."""

    def __init__(self) -> None:
        self.writes: list[int] = []
        self._done: list[tuple[int, bool]] = []
        self._stored: set[int] = set()
        self._released = 0

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._stored

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        return next((i for i, h in enumerate(block_hashes) if h not in self._stored), len(block_hashes))

    def record(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        pass

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        self.writes.append(ref.block_hash)
        return len(self.writes)

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        return None

    def release(self) -> None:
        """Finish the writes submitted so far."""
        self._done += [(job, True) for job in range(self._released + 1, len(self.writes) + 1)]
        self._stored.update(self.writes)
        self._released = len(self.writes)

    def poll(self) -> list[tuple[int, bool]]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
        raise AssertionError("the engine loop never waits for the store")

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def test_a_store_missing_a_method_cannot_be_made():
    class ReadsOnly(BlockStore):
        def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
            return None

    with pytest.raises(TypeError, match="abstract method"):
        ReadsOnly()


def cached_pool(num_blocks: int, num_cached: int) -> BlockPool:
    """A CPU pool whose first `num_cached` blocks hold cached prefix blocks nobody owns."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_cached)
    for i, block in enumerate(blocks):
        pool.cache(block, 1000 + i, 0, (i,) * 4)
    pool.release(blocks)
    return pool


@pytest.fixture
def sixteen_in_flight(monkeypatch):
    """The write bound at its floor, `MIN_WRITES_IN_FLIGHT`, for these tests' tiny blocks (a
    byte bound would let them write every block at once)."""
    monkeypatch.setattr(spill_module, "WRITE_BYTES_IN_FLIGHT", 0)


def test_writes_in_flight_cover_a_long_step_of_the_disks_time(monkeypatch):
    """Writes are topped up between steps: 512 MiB in flight keep the disk writing through a
    step of ~0.3 s, as 256 blocks of 2 MiB or 32 of 16 MiB; never fewer than 16. A spill
    writes that many of its window's blocks at once (here the bound is 40 of its blocks)."""
    assert [write_bound(mib << 20) for mib in (2, 16, 64)] == [256, 32, MIN_WRITES_IN_FLIGHT]
    blocks = torch.zeros((256, *BLOCK_SHAPE))
    monkeypatch.setattr(spill_module, "WRITE_BYTES_IN_FLIGHT", 40 * blocks[0].nbytes)
    store = BehindStore()
    spill = Spill(store, cached_pool(256, 200), blocks)  # a write window of 64
    spill.spill_ahead(reads_in_flight=0)
    assert spill.max_writes == 40 and store.writes == list(range(1000, 1040))  # the coldest 40


def test_spills_are_dropped_not_queued_when_the_store_is_behind(sixteen_in_flight):
    store = BehindStore()
    pool = cached_pool(128, 64)  # 8 staging blocks, a write window of 32
    spill = Spill(store, pool, torch.zeros((128, *BLOCK_SHAPE)))
    spill.spill_ahead(reads_in_flight=0)
    assert store.writes == list(range(1000, 1000 + MIN_WRITES_IN_FLIGHT))  # the coldest, up to the bound
    spill.spill_ahead(reads_in_flight=0)
    assert len(store.writes) == MIN_WRITES_IN_FLIGHT  # behind: nothing more is submitted
    staging = spill.stage(reads_in_flight=0)  # a demotion bound for disk waits in a staging block
    spill.write_staged(staging, ref(7), reads_in_flight=0)
    assert len(store.writes) == MIN_WRITES_IN_FLIGHT and spill.staged_waited == 1  # not queued on the disk
    store.release()
    assert spill.poll() == [] and spill.writes_in_flight == 0  # the writes were booked
    spill.spill_ahead(reads_in_flight=1)
    assert len(store.writes) == MIN_WRITES_IN_FLIGHT  # no write beside a read, not even the waiting copy
    spill.spill_ahead(reads_in_flight=0)  # the reads are done: the waiting copy goes first, then spill-ahead
    assert store.writes[MIN_WRITES_IN_FLIGHT] == ref(7).block_hash
    assert len(store.writes) == 2 * MIN_WRITES_IN_FLIGHT and spill.writes_in_flight == MIN_WRITES_IN_FLIGHT
    assert spill.dropped == 0


def test_a_block_written_ahead_keeps_its_place_in_the_cpu_tiers_order(sixteen_in_flight):
    """Spill-ahead pins the blocks it writes (never evicted meanwhile) and leaves the CPU tier's
    order alone: once on disk a block is evicted in its turn, not sooner."""
    store = BehindStore()
    pool = cached_pool(128, 64)  # a write window of 32: the 16 coldest are written
    spill = Spill(store, pool, torch.zeros((128, *BLOCK_SHAPE)))
    order = [b.block_id for b in pool.cold_blocks()]
    spill.spill_ahead(reads_in_flight=0)
    written = set(order[:MIN_WRITES_IN_FLIGHT])
    assert [b.block_id for b in pool.cold_blocks()] == [i for i in order if i not in written]  # pinned
    store.release()
    assert spill.poll() == [] and spill.writes_in_flight == 0
    assert [b.block_id for b in pool.cold_blocks()] == order  # back where they stood


def test_staged_copies_wait_for_the_disk_newest_first_and_the_oldest_make_way():
    store = BehindStore()
    pool = cached_pool(128, 0)  # 8 staging blocks, nothing cached to spill ahead
    spill = Spill(store, pool, torch.zeros((128, *BLOCK_SHAPE)))
    staged = [spill.stage(reads_in_flight=1) for _ in range(8)]
    for i, block in enumerate(staged):
        spill.write_staged(block, ref(100 + i), reads_in_flight=1)  # reads in flight: all eight wait
    assert store.writes == [] and spill.staged_waited == 8 and spill.held_blocks == 8
    # every staging block holds a waiting copy: the oldest gives its block to a new demotion
    newest = spill.stage(reads_in_flight=1)
    assert newest is staged[0] and spill.dropped == 1
    spill.write_staged(newest, ref(200), reads_in_flight=1)
    spill.spill_ahead(reads_in_flight=0)  # no read in flight: newest first, up to the bound
    assert store.writes == [200] + [100 + i for i in range(7, 0, -1)]
    # every staging block is being written: a demotion is dropped before its copy
    assert spill.stage(reads_in_flight=0) is None and (spill.dropped, spill.staging_full) == (2, 1)
    store.release()
    assert spill.poll() == [] and spill.writes_in_flight == 0
    assert spill.stage(reads_in_flight=0) is not None and spill.held_blocks == 8


def test_a_swap_out_takes_idle_staging_blocks_and_the_spill_takes_them_back_once_free():
    """Staging blocks not in use are lent to a swap-out: free ones first, then those of the
    oldest copies waiting for the disk (dropped); a copy being written is kept. The spill takes
    them back between steps, from blocks the CPU tier has free again."""
    store = BehindStore()
    pool = cached_pool(128, 0)  # 8 staging blocks
    spill = Spill(store, pool, torch.zeros((128, *BLOCK_SHAPE)))
    staged = [spill.stage(reads_in_flight=1) for _ in range(6)]
    spill.write_staged(staged[0], ref(100), reads_in_flight=0)  # being written
    for i, block in enumerate(staged[1:]):
        spill.write_staged(block, ref(101 + i), reads_in_flight=1)  # five wait for the disk
    assert spill.lendable == 7  # two free, five waiting
    swap = pool.allocate(pool.num_free)  # a swap-out takes every free block of the tier ...
    assert spill.lend(3) == 3 and spill.dropped == 1  # ... and three staging blocks, one with a copy
    swap += pool.allocate(3)
    assert spill.held_blocks == 5 and spill.lendable == 4
    spill.spill_ahead(reads_in_flight=1)
    assert spill.held_blocks == 5  # nothing free to take back
    pool.release(swap[:2])  # the sequence swapped in again
    spill.spill_ahead(reads_in_flight=1)
    assert spill.held_blocks == 7 and spill.lendable == 6
    assert spill.lent_blocks == 3
    spill.write_staged(spill.stage(reads_in_flight=1), ref(200), reads_in_flight=1)
    store.release()
    spill.poll()
    spill.spill_ahead(reads_in_flight=0)  # the waiting copies go down, newest first
    assert store.writes == [100, 200, 105, 104, 103, 102]  # 101, the oldest, was dropped


class KeepsWhatItHas(AdmitAll):
    """An admission policy that turns every demotion down once the tier is full."""

    def admits(self, candidate: int, victim: int) -> bool:
        return False


def full_tier_behind_a_burst() -> tuple[CPUOffload, BehindStore]:
    """A full CPU tier (1 staging block) that turns every demotion down, over a disk with
    `MIN_WRITES_IN_FLIGHT` spill-ahead writes in flight, after one step evicted a chain of 10
    blocks tail first: 909, 908, ..., 900 (its head)."""
    gpu = torch.zeros((BLOCK_SHAPE[0], 2, 64, *BLOCK_SHAPE[2:]))
    tier = CPUTier(24, BLOCK_SHAPE, gpu.dtype, pin=False)  # 1 staging block, 23 for the tier
    store = BehindStore()
    offload = CPUOffload(tier, TransferEngine(gpu, tier.data), store, "lru")
    offload.admission = offload.lower.admission = offload.lower.spill.admission = KeepsWhatItHas()
    for i in range(23):  # free CPU blocks are taken whatever the policy
        offload.demote(Block(i, block_hash=500 + i, parent_hash=0, token_ids=(i,)))
    offload.flush()
    offload.drain()
    chain = [Block(23 + i, block_hash=900 + i, parent_hash=900 + i - 1, token_ids=(i,)) for i in range(10)]
    for block in reversed(chain):
        offload.demote(block)
    offload.flush()
    offload.drain()
    return offload, store


class AdmitsOnly(AdmitAll):
    """An admission policy that keeps only the demotions it is given, whatever the victim; it
    notes what it was asked: ("admits", victim) or ("admits_spare", coldest)."""

    def __init__(self, *kept: int) -> None:
        self.kept, self.asked = set(kept), []

    def admits(self, candidate: int, victim: int) -> bool:
        self.asked.append(("admits", victim))
        return candidate in self.kept

    def admits_spare(self, candidate: int, coldest: int) -> bool:
        self.asked.append(("admits_spare", coldest))
        return candidate in self.kept


def test_a_block_read_back_makes_way_for_a_demotion_the_tier_would_keep_and_only_for_one():
    # a block read back from the tier below for one request waits at the eviction end (its copy
    # stays below): weighed against newcomers by a frequency admission, it won, as it had just
    # been asked for, and turned them all away (with a disk under it the CPU tier served half
    # its hits on the Mooncake synthetic slice); let in unweighed, every demotion took its place,
    # and on multi_turn_8b the tier kept 8x the demotions it kept without a disk under it, for
    # fewer hits: the newcomer is weighed against the coldest block the tier keeps instead
    # (`admits_spare`: it displaces nothing kept, so a tie is enough)
    gpu = torch.zeros((BLOCK_SHAPE[0], 2, 64, *BLOCK_SHAPE[2:]))
    tier = CPUTier(24, BLOCK_SHAPE, gpu.dtype, pin=False)  # 1 staging block, 23 for the tier
    offload = CPUOffload(tier, TransferEngine(gpu, tier.data), BehindStore(), "lru")
    admission = AdmitsOnly(700, 703)
    offload.admission = offload.lower.admission = offload.lower.spill.admission = admission
    for i in range(23):
        offload.demote(Block(i, block_hash=500 + i, parent_hash=0, token_ids=(i,)))
    offload.flush()
    offload.drain()
    read_back = [offload.pool.cached_block(515), offload.pool.cached_block(516)]
    for block in read_back:  # as reads from below leave them: used once, then at the eviction end
        offload.pool.touch(block)
        block.evict_first = True
        offload.pool.release([block])
    coldest = offload.pool.next_kept_victim()
    assert offload.pool.next_victim() is read_back[1] and coldest.block_hash < 515
    offload.demote(Block(30, block_hash=702, parent_hash=0, token_ids=(30,)))  # not one the tier keeps
    assert offload.pool.cached_block(702) is None and offload.rejected_blocks == 1
    assert all(offload.pool.cached_block(b.block_hash) is b for b in read_back)
    offload.demote(Block(31, block_hash=700, parent_hash=0, token_ids=(31,)))
    offload.flush()  # a demotion is findable once its copy is on its way
    assert offload.pool.cached_block(700) is not None and offload.pool.cached_block(516) is None
    assert offload.pool.cached_block(coldest.block_hash) is coldest and offload.pool.cached_block(515) is not None
    offload.demote(Block(32, block_hash=703, parent_hash=0, token_ids=(32,)))  # the last place read back
    offload.flush()
    assert offload.pool.cached_block(703) is not None and offload.pool.cached_block(515) is None
    offload.demote(Block(33, block_hash=704, parent_hash=0, token_ids=(33,)))  # now against a kept block
    assert offload.pool.cached_block(704) is None and offload.pool.cached_block(coldest.block_hash) is coldest
    spare, kept = ("admits_spare", coldest.block_hash), ("admits", coldest.block_hash)
    assert admission.asked == [spare, spare, spare, kept]  # never the blocks read back


def test_a_burst_of_demotions_stages_the_last_ones_the_heads_of_chains_evicted_tail_first():
    offload, store = full_tier_behind_a_burst()
    store.release()  # the disk catches up: the waiting copy is written first
    offload.retire()
    assert [h for h in store.writes if h >= 900] == [900]  # the staging block went to the head, not the tail
    assert offload.lower.spill.dropped == 9


def test_between_requests_the_tiers_are_tended_until_their_writes_are_done():
    offload, store = full_tier_behind_a_burst()
    kv = KVCacheManager(64, BLOCK_SHAPE[2], 7, offload)
    assert kv.tend() == 0  # no step runs, but writes are in flight and a copy waits for the disk
    for _ in range(10):
        store.release()
        if kv.tend() is None:
            break
    assert kv.tend() is None and 900 in store.writes  # written with no step, and nothing left in flight
    assert KVCacheManager(64, BLOCK_SHAPE[2], 7).tend() is None  # no tiers below the GPU: nothing to tend


def test_only_transfers_that_finish_between_steps_keep_the_tiers_tended():
    class StepReported(TransferEngine):
        finishes_between_steps = False  # as a tensor-parallel engine's: the ranks tell in a step's replies

    gpu = torch.zeros((BLOCK_SHAPE[0], 2, 8, *BLOCK_SHAPE[2:]))
    for transfers, busy in ((TransferEngine, True), (StepReported, False)):
        tier = CPUTier(8, BLOCK_SHAPE, gpu.dtype, pin=False)
        offload = CPUOffload(tier, transfers(gpu, tier.data))
        offload.demote(Block(0, block_hash=1, parent_hash=0, token_ids=(0,)))
        offload.flush()  # a D2H copy in flight, not booked yet
        assert offload.busy is busy
        offload.retire()
        assert not offload.busy


class RefusingStore(BehindStore):
    """A store whose policy keeps what it holds: every write is refused, none started."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[int] = []

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        self.offered.append(ref.block_hash)
        return None


def test_a_write_the_store_refuses_is_no_fault_and_not_offered_again_at_once(monkeypatch, caplog):
    """A store's policy declining a write (or every slot busy) starts no I/O and is no disk
    fault: spilling does not pause, and spill-ahead, which scans its window every step, offers
    that block again only after `REFUSED_RETRY_S`."""
    from tieredkv.cache import spill as spill_module

    clock = [100.0]
    monkeypatch.setattr(spill_module.time, "monotonic", lambda: clock[0])
    store = RefusingStore()
    spill = Spill(store, cached_pool(128, 64), torch.zeros((128, *BLOCK_SHAPE)))
    with caplog.at_level(logging.WARNING, logger="tieredkv"):
        for _ in range(20):
            spill.spill_ahead(reads_in_flight=0)
    window = sorted(set(store.offered))
    assert store.offered == window and len(window) == spill.window  # the coldest window, each once
    assert not spill.paused and not caplog.records
    clock[0] += spill_module.REFUSED_RETRY_S
    spill.spill_ahead(reads_in_flight=0)
    assert len(store.offered) == 2 * len(window)  # offered again: the store's policy may take it now


class HungReads(BehindStore):
    """A store that holds every block and whose reads finish only when `finish()` is called
    (a disk whose reads hang)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[int] = []
        self.lost: set[int] = set()

    def contains(self, block_hash: int) -> bool:
        return True

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        return len(block_hashes)

    def record(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        pass

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        if ref.block_hash in self.lost:  # gone since the lookup (the file was deleted, say)
            return None
        self.reads.append(ref.block_hash)
        return -len(self.reads)

    def finish(self) -> None:
        self._done = [(-i, True) for i in range(1, len(self.reads) + 1)]


def test_a_read_that_hangs_is_given_up_and_its_request_computes(monkeypatch):
    from tieredkv.cache import lower_tier

    clock = [100.0]
    monkeypatch.setattr(lower_tier.time, "monotonic", lambda: clock[0])
    store, pool = HungReads(), BlockPool(8)
    lower = lower_tier.LowerTier(store, pool, torch.zeros((8, *BLOCK_SHAPE)), AdmitAll())
    free = pool.num_free  # (less the spill's staging blocks)
    assert lower.plan("r", [ref(1), ref(2), ref(3)], load_from=16) == 3
    clock[0] += lower_tier.STALLED_READ_S - 0.1
    lower.retire()
    assert lower.arriving("r") and lower.stalled_loads == 0
    clock[0] += 0.2
    lower.retire()
    # given up: the request no longer waits (it computes those tokens) and the planner learns how long it waited
    assert not lower.arriving("r") and lower.stalled_loads == 3
    assert lower.reads_in_flight == 3  # the store still owns the reads...
    [landed] = lower.landed_loads()
    assert landed.num_blocks == 3 and landed.seconds > lower_tier.STALLED_READ_S
    lower.landed("r")
    assert pool.num_free == free - 3  # ...so their CPU blocks stay taken until they report
    hashes = [4, 5, 6]
    assert lower.held_run(hashes, 0) == 0  # while they are out the tier hangs: no load is planned on it
    store.finish()
    lower.retire()
    assert lower.reads_in_flight == 0 and pool.num_free == free
    assert lower.failed_loads == 0 and lower.loaded_blocks == 3  # late, intact: cached
    assert lower.held_run(hashes, 0) == 3  # back: loads are planned again


def test_a_request_that_gives_up_its_late_reads_computes_and_they_still_land_in_the_cpu_tier():
    store, pool = HungReads(), BlockPool(12)
    lower = LowerTier(store, pool, torch.zeros((12, *BLOCK_SHAPE)), AdmitAll())
    free = pool.num_free
    assert lower.plan("ahead", [ref(h) for h in (1, 2, 3, 4)], load_from=0) == 4
    assert lower.plan("r", [ref(5), ref(6)], load_from=32) == 2
    assert lower.late("r") is None  # not found waiting yet
    lower.await_loads("r")
    assert lower.late("r") == (32, 0, 2, 6)  # from token 32: none in, 2 in flight, 6 reads up to its last
    lower.give_up("r")
    assert not lower.arriving("r") and lower.wait_state("r") is LoadWait.LANDED and lower.late_loads == 2
    assert lower.arriving("ahead") and lower.held_run([7], 0) == 1  # no hang: the tier still holds blocks
    lower.landed("r")
    store.finish()
    lower.retire()
    # only loads waited for teach the read rate: r's reads landed after it stopped waiting
    assert [(load.request_id, load.num_blocks) for load in lower.landed_loads()] == [("ahead", 4)]
    assert lower.reads_in_flight == 0 and lower.loaded_blocks == 6
    assert pool.num_free == free - 4  # r's two blocks are cached and free; ahead still holds its four
    assert pool.lookup(5, parent_of(5), tuple(tokens_of(5))) is not None


def test_a_request_planned_again_holds_the_blocks_its_old_reads_bring_and_waits_for_them():
    store, pool = HungReads(), BlockPool(16)
    lower = LowerTier(store, pool, torch.zeros((16, *BLOCK_SHAPE)), AdmitAll())
    free = pool.num_free
    assert lower.plan("r", [ref(h) for h in (1, 2, 3, 4)], load_from=0) == 4
    lower.forget("r")  # freed (preempted, say) while its four reads are out
    assert lower.plan("r", [ref(1), ref(2), ref(5)], load_from=0) == 3
    assert store.reads == [1, 2, 3, 4, 5]  # blocks 1 and 2 are not read again: their reads are out
    lower.await_loads("r")
    # none of its new plan's three blocks is in yet; it waits for its five reads (the queue)
    assert lower.late("r") == (0, 0, 3, 5)
    store.finish()
    lower.retire()
    assert lower.late("r") is None and lower.wait_state("r") is LoadWait.LANDED
    assert lower.loaded_blocks == 5 and pool.num_free == free - 3  # it holds 1, 2 and 5; 3 and 4 are free
    lower.landed("r")
    assert pool.num_free == free
    assert all(pool.lookup(h, parent_of(h), tuple(tokens_of(h))) is not None for h in (1, 2, 3, 4, 5))


def test_a_plan_whose_first_read_misses_keeps_the_blocks_its_old_reads_still_fill():
    """Planned again, the request takes back the blocks its reads from before still fill; when
    the new plan's first read then misses at submit, those blocks stay held until their reads
    land. (They were released: the CPU tier could give one to another block, which the old
    read then overwrote: another block's KV served as its own.)"""
    store, pool = HungReads(), BlockPool(16)
    lower = LowerTier(store, pool, torch.zeros((16, *BLOCK_SHAPE)), AdmitAll())
    free = pool.num_free
    assert lower.plan("r", [ref(3), ref(4)], load_from=32) == 2
    lower.forget("r")  # freed while its two reads are out
    store.lost = {1}
    assert lower.plan("r", [ref(h) for h in (1, 2, 3, 4)], load_from=0) == 0  # block 1 misses: nothing
    assert pool.num_free == free - 2  # the blocks of the reads of 3 and 4 are still theirs
    store.finish()
    lower.retire()
    assert pool.num_free == free and store.reads == [3, 4]
    assert all(pool.lookup(h, parent_of(h), tuple(tokens_of(h))) is not None for h in (3, 4))


def cached_block(pool: BlockPool, h: int):
    """A block of `pool` caching `ref(h)`, owned by nobody."""
    [block] = pool.allocate(1)
    pool.cache(block, h, parent_of(h), tokens_of(h))
    pool.release([block])
    return block


def test_a_block_the_cpu_tier_holds_is_held_for_the_request_not_read():
    """The match stops the CPU run at its first miss; a later block the CPU tier holds is held
    by the plan, not read again from the store (a read it could not even cache)."""
    store, pool = HungReads(), BlockPool(8)
    lower = LowerTier(store, pool, torch.zeros((8, *BLOCK_SHAPE)), AdmitAll())
    second = cached_block(pool, 2)
    assert lower.plan("r", [ref(1), ref(2), ref(3)], load_from=16) == 3
    assert store.reads == [1, 3] and second.ref_count == 1
    assert lower.arriving("r") and lower.num_planned("r") == 3
    store.finish()
    lower.retire()
    lower.landed("r")
    assert second.ref_count == 0 and pool.lookup(2, parent_of(2), tokens_of(2)) is second


class EvictedReads(HungReads):
    """`HungReads` whose blocks in `evicted` left the store since the lookup: their reads miss."""

    def __init__(self, evicted: set[int]) -> None:
        super().__init__()
        self.evicted = evicted

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        return None if ref.block_hash in self.evicted else super().submit_read(ref, dst)


def test_a_block_evicted_from_the_store_since_the_lookup_ends_the_plan_there():
    """The plan's reads go to the store in one batch, which stops at the first miss (a block
    evicted since `held_run`): the plan brings the blocks before it; the CPU blocks taken for it
    and for every block after it, read or held from the CPU tier, are let go."""
    store, pool = EvictedReads({3}), BlockPool(16)
    lower = LowerTier(store, pool, torch.zeros((16, *BLOCK_SHAPE)), AdmitAll())
    fifth = cached_block(pool, 5)
    free = pool.num_free
    assert lower.plan("r", [ref(h) for h in (1, 2, 3, 4, 5)], load_from=0) == 2
    assert store.reads == [1, 2] and lower.reads_in_flight == 2 and lower.num_planned("r") == 2
    assert pool.num_free == free - 2 and fifth.ref_count == 0
    assert pool.lookup(5, parent_of(5), tokens_of(5)) is fifth
    store.finish()
    lower.retire()
    lower.landed("r")
    assert pool.num_free == free and lower.loaded_blocks == 2 and not lower.busy


def test_a_waiting_request_holds_its_cpu_hits_until_admitted_or_freed():
    """While a request waits for its loads, the CPU blocks before them are held: loads (its own
    or others') take CPU blocks, and would evict the prefix the request was planned on."""
    store, pool = HungReads(), BlockPool(8)
    lower = LowerTier(store, pool, torch.zeros((8, *BLOCK_SHAPE)), AdmitAll())
    hits = [cached_block(pool, h) for h in (1, 2)]
    assert lower.plan("r", [ref(3)], load_from=32, hits=hits) == 1
    assert [b.ref_count for b in hits] == [1, 1]
    free = pool.num_free
    assert lower.plan("other", [ref(h) for h in range(10, 20)], load_from=0) == free  # takes every free block
    # not evicted
    assert all(pool.lookup(h, parent_of(h), tokens_of(h)) is b for h, b in zip((1, 2), hits, strict=True))
    lower.forget("r")
    assert [b.ref_count for b in hits] == [0, 0]
    # a plan that reads nothing holds nothing
    assert lower.plan("s", [], load_from=32, hits=hits) == 0 and [b.ref_count for b in hits] == [0, 0]


def test_an_admitted_request_holds_its_loaded_blocks_until_it_reaches_them():
    """Admitted while its loads arrive (it computes the tokens before them meanwhile), a request
    lets go of its CPU hits (copied in by then) but not of the blocks its loads bring: released
    at admission, they sat at the eviction end and were evicted before it reached them."""
    store, pool = HungReads(), BlockPool(8)
    lower = LowerTier(store, pool, torch.zeros((8, *BLOCK_SHAPE)), AdmitAll())
    hits = [cached_block(pool, 1)]
    assert lower.plan("r", [ref(2), ref(3)], load_from=16, hits=hits) == 2
    lower.admitted("r")
    assert hits[0].ref_count == 0
    store.finish()
    lower.retire()
    loaded = [pool.lookup(h, parent_of(h), tokens_of(h)) for h in (2, 3)]
    assert all(b is not None and b.ref_count == 1 for b in loaded)  # cached, and still held
    lower.landed("r")
    assert [b.ref_count for b in loaded] == [0, 0]


def test_a_request_s_own_reads_do_not_evict_its_cpu_hits():
    """Its hits are held before its reads take CPU blocks: a plan longer than the free blocks
    stops short instead of evicting the prefix it starts from."""
    store, pool = HungReads(), BlockPool(8)
    lower = LowerTier(store, pool, torch.zeros((8, *BLOCK_SHAPE)), AdmitAll())
    hits = [cached_block(pool, h) for h in (1, 2)]
    empty = pool.num_free - len(hits)  # (less the spill's staging block)
    assert lower.plan("r", [ref(h) for h in range(3, 20)], load_from=32, hits=hits) == empty
    assert all(pool.lookup(h, parent_of(h), tokens_of(h)) is b for h, b in zip((1, 2), hits, strict=True))


def test_an_idle_engine_tends_a_hung_tier_less_and_less_often(monkeypatch):
    from tieredkv import LLM
    from tieredkv.engine import MAX_TEND_EVERY_S, TEND_EVERY_S

    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=32) as llm:
        finished = [0]  # what each tend finds finished; the tier's I/O stays in flight throughout
        monkeypatch.setattr(llm.kv, "tend", lambda: finished[0])
        waits = [llm.tend_tiers() for _ in range(12)]
        assert waits[:3] == [2 * TEND_EVERY_S, 4 * TEND_EVERY_S, 8 * TEND_EVERY_S]  # nothing finished
        assert waits[-1] == MAX_TEND_EVERY_S and max(waits) == MAX_TEND_EVERY_S
        finished[0] = 3  # the disk is back: the loop tends at its short pace again
        assert llm.tend_tiers() == TEND_EVERY_S
        finished[0] = None  # nothing left in flight
        assert llm.tend_tiers() is None


def test_a_long_write_down_at_close_says_how_far_it_got(monkeypatch, caplog, sixteen_in_flight):
    from tieredkv.cache import spill

    class SlowStore(BehindStore):
        def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
            time.sleep(0.005)  # a slow disk: each write takes a while
            return dict.fromkeys(job_ids, True)

    monkeypatch.setattr(spill, "CLOSING_PROGRESS_S", 0.05)
    store = SlowStore()
    pool = cached_pool(256, 200)
    with caplog.at_level(logging.INFO, logger="tieredkv"):
        Spill(store, pool, torch.zeros((256, *BLOCK_SHAPE))).persist()
    said = [r.getMessage() for r in caplog.records if "so far" in r.getMessage()]
    assert len(said) >= 2 and len(store.writes) == 200  # progress along the way, then every block written
