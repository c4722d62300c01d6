"""Scheduler + KV cache manager scenarios with no model: scripted steps through
`Scheduler.update`, exact block ids, queues and tier moves. Every step also checks that each
scheduled sequence reads back exactly its own tokens' KV (tests/kv_factory.py)."""

from __future__ import annotations

import time

import pytest

from tests.kv_factory import (
    BLOCK_BYTES,
    check_kv,
    make_kv,
    make_scheduler,
    make_seq,
    run_step,
    run_until_done,
    write_kv,
)
from tests.test_nvme_store import GatedBackend
from tieredkv.cache.manager import Landed
from tieredkv.cache.prefix import PrefixMatch
from tieredkv.policy import CostModel
from tieredkv.sequence import SequenceStatus
from tieredkv.tiers.nvme.io_backends import SyncBackend

SWAP_WINS = CostModel(d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15, prefill_s_per_token=1.0)
RECOMPUTE_WINS = CostModel(d2h_bytes_per_s=1.0, h2d_bytes_per_s=1.0, prefill_s_per_token=1e-9)
# 1 ms of prefill a token (4 ms a block); 3 ms to read a block (a read alone pays); PCIe free
BALANCED = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 3e-3)


def queues(sched) -> tuple[list[str], list[str], list[str]]:
    return tuple([s.request_id for s in q] for q in (sched.waiting, sched.running, sched.swapped))


def two_decoders(preemption: str, cost: CostModel | None = None):
    """Two 7-token prompts on 5 GPU blocks of 4 tokens: both fit until their third block."""
    sim = make_kv(5, num_cpu_blocks=8)
    sched = make_scheduler(sim, preemption, cost)
    a, b = make_seq("a", range(1, 8)), make_seq("b", range(11, 18))
    sched.add(a)
    sched.add(b)
    assert [(s.seq, s.num_new_tokens) for s in run_step(sched, sim).scheduled] == [(a, 7), (b, 7)]
    run_step(sched, sim)
    assert sim.kv.block_table(a) == [0, 1] and sim.kv.block_table(b) == [2, 3]
    out = run_step(sched, sim)  # both need a third block; one is left
    assert out.preempted == [b] and [s.seq for s in out.scheduled] == [a]  # the newest goes
    return sim, sched, a, b


def test_recompute_puts_the_victim_back_in_front_and_reuses_its_cached_prefix():
    sim, sched, a, b = two_decoders("recompute")
    assert queues(sched) == (["b"], ["a"], [])
    assert sched.num_preemptions == {"recompute": 1, "swap": 0}
    assert b.num_computed_tokens == 0 and sim.kv.block_table(b) == []
    steps = run_until_done(sched, sim)
    # b came back with its first block still on the GPU and its second promoted from the CPU: it
    # computes one token; finding its own blocks again is not a hit of a client's prompt
    b_chunks = [s.num_new_tokens for out in steps for s in out.scheduled if s.seq is b]
    assert b_chunks[0] == 1 and sim.kv.stats()["cpu_hit_blocks"] == 1
    assert b.num_cached_tokens == 0 and sim.kv.stats()["prefix_hit_tokens"] == 0
    assert a.output_token_ids == b.output_token_ids and len(b.output_token_ids) == 8
    assert sim.kv.stats()["gpu_blocks_used"] == 0 and sim.kv.stats()["cpu_blocks_used"] == 0


def test_auto_swaps_when_copies_are_cheap_and_swaps_back_into_exact_blocks():
    sim, sched, a, b = two_decoders("auto", SWAP_WINS)
    assert queues(sched) == ([], ["a"], ["b"])
    assert sim.kv.stats()["bytes_d2h"] == 2 * BLOCK_BYTES  # its two blocks of computed KV
    steps = run_until_done(sched, sim)
    resumed = next(i for i, out in enumerate(steps) if b in [s.seq for s in out.scheduled])
    # its first block was still cached on the GPU: taken back as it is, only the second is copied
    assert sim.kv.stats()["bytes_h2d"] == BLOCK_BYTES
    assert sched.num_preemptions == {"recompute": 0, "swap": 1} and sched.num_swap_fallbacks == 0
    assert resumed == 6  # a finished at step 4 of these; the swap-in landed beside step 5
    assert sim.kv.stats()["gpu_blocks_used"] == 0 and sim.kv.stats()["cpu_blocks_used"] == 0


def test_swap_in_takes_the_free_queue_front_first():
    sim, sched, a, b = two_decoders("swap")
    while "b" not in queues(sched)[1]:
        run_step(sched, sim)
    # its first block, still cached, is taken back; the others come from the free queue front:
    # a's partial last block, then the least recently used cached block
    assert sim.kv.block_table(b) == [2, 3, 4]


def test_auto_recomputes_when_copies_are_slow():
    sim, sched, a, b = two_decoders("auto", RECOMPUTE_WINS)
    assert queues(sched) == (["b"], ["a"], []) and sim.kv.stats()["bytes_d2h"] == 0


def test_a_swap_in_that_cannot_start_costs_that_sequence_a_recompute():
    sim, sched, a, b = two_decoders("swap")
    sim.transfers.inject("h2d", every=1)
    run_until_done(sched, sim)
    assert sched.num_swap_fallbacks == 1 and sim.transfers.injected >= 1
    assert a.output_token_ids == b.output_token_ids and len(b.output_token_ids) == 8
    assert sim.kv.stats()["gpu_blocks_used"] == 0 and sim.kv.stats()["cpu_blocks_used"] == 0


def compute(sim, seq, n: int) -> None:
    """The forward pass of `n` more tokens (`write_kv`); full blocks cached."""
    write_kv(sim, seq, n)
    seq.num_computed_tokens += n
    sim.kv.commit(seq)


def test_a_demotion_is_found_only_once_its_copy_is_on_its_way():
    """A GPU eviction queues its block's copy into the CPU tier; found before that copy was
    submitted, a promotion or a swap-out sharing it took a block whose copy could still fail to
    start: it then held content that never arrived (a crash, or wrong KV on swap-in)."""
    sim = make_kv(num_gpu_blocks=8, num_cpu_blocks=8)
    kv = sim.kv
    prompt = list(range(1, 9))  # two full blocks
    x, y = make_seq("x", prompt), make_seq("y", prompt)
    kv.allocate(x, 8, PrefixMatch()), kv.allocate(y, 8, PrefixMatch())
    compute(sim, x, 8), compute(sim, y, 8)  # x's blocks cached; y's not (their hashes are taken)
    y.token_ids.append(42)
    kv.free(x)
    z = make_seq("z", list(range(50, 74)))
    kv.allocate(z, 24, PrefixMatch())  # evicts x's cached blocks: their demotions are queued
    assert kv.match_prefix(make_seq("w", prompt + [0])).cpu_blocks == ()
    assert kv.swap_out(y)  # copies its own blocks: nothing to share yet
    sim.transfers.inject("d2h", every=1)  # the queued demotions' copy fails to start
    kv.before_forward()
    kv.free(z), kv.retire()
    assert kv.swap_in(y, 1) is not None
    kv.retire()
    check_kv(sim, y)
    assert kv.match_prefix(make_seq("w", prompt + [0])).cpu_blocks == ()  # never arrived: never found
    kv.free(y)
    assert kv.stats()["gpu_blocks_used"] == 0 and kv.stats()["cpu_blocks_used"] == 0


def test_a_swap_out_copy_holds_its_cpu_blocks_until_it_has_landed():
    """A sequence aborted while swapped out frees its CPU blocks, but its copy out may still be
    writing them: they stay taken until the copy is reported done (else the next CPU block
    taken, e.g. for a read from the disk, is overwritten by the late copy)."""
    sim = make_kv(num_gpu_blocks=8, num_cpu_blocks=8)
    kv, cpu = sim.kv, sim.kv.offload.pool
    s = make_seq("s", [1, 2, 3, 4, 5, 6])
    kv.allocate(s, 6, PrefixMatch())
    compute(sim, s, 6)
    free = cpu.num_free
    assert kv.swap_out(s)
    kv.free(s)  # aborted while swapped out, before the copy was seen to finish
    assert cpu.num_free < free
    kv.retire()
    assert cpu.num_free == free


def cpu_contents(sim) -> list[int]:
    """First token of each unowned CPU block's content, next to evict first (None: empty)."""
    return [b.token_ids and b.token_ids[0] for b in sim.kv.offload.pool.free_blocks()]


def run_prompts(sched, sim, prompts: list[list[int]]) -> None:
    for i, tokens in enumerate(prompts):
        sched.add(make_seq(f"p{i}", tokens, max_tokens=1))
        run_until_done(sched, sim)
        sim.kv.retire()  # the demotions of the last step have finished


def test_gpu_evictions_demote_least_recent_first_into_an_lru_cpu_tier():
    sim = make_kv(4, num_cpu_blocks=4, cpu_policy="lru")
    sched = make_scheduler(sim, "recompute")
    firsts = []
    for i in range(4):  # 9-token prompts: two full blocks each, cached when done
        run_prompts(sched, sim, [[i * 10 + j for j in range(9)]])
        firsts.append(cpu_contents(sim))
    assert firsts[0] == [None] * 4
    # p1 evicted p0's second block (released first); p2 its first and p1's second, p3 ...
    assert firsts[1] == [None, None, None, 4]
    assert firsts[2] == [None, 4, 0, 14]
    assert firsts[3] == [0, 14, 10, 24]


def test_a_full_cpu_tier_admits_only_blocks_asked_for_more_often_than_its_victim():
    """Cyclic reuse over more prefixes than the CPU tier holds: LRU evicts each user just
    before it returns; frequency admission keeps part of them resident and serves them."""
    users = [[u * 100 + j for j in range(13)] for u in range(6)]  # 3 full blocks each: 18 > 4 + 8
    hits = {}
    for policy in ("lru", "tinylfu"):
        sim = make_kv(4, num_cpu_blocks=8, cpu_policy=policy)
        run_prompts(make_scheduler(sim, "recompute"), sim, users * 4)
        hits[policy] = sim.kv.stats()["cpu_hit_blocks"]
        if policy == "tinylfu":
            assert sim.kv.stats()["cpu_rejected_blocks"] > 0
    assert hits["lru"] == 0 and hits["tinylfu"] >= 12


def test_spill_writes_each_block_once_and_never_evicts_one_being_written(tmp_path):
    sim = make_kv(4, num_cpu_blocks=8, nvme_path=str(tmp_path))
    sched = make_scheduler(sim, "recompute")
    users = [[u * 100 + j for j in range(9)] for u in range(6)]  # 2 full blocks each
    store = sim.kv.offload.lower.store
    written = []
    submit_write = store.submit_write

    def spy(ref, src):
        held = [b for b in sim.kv.offload.pool.blocks if b.block_hash == ref.block_hash]
        assert all(not sim.kv.offload.pool.is_free(b) for b in held)  # never evicted mid-write
        written.append(ref.block_hash)
        return submit_write(ref, src)

    store.submit_write = spy
    run_prompts(sched, sim, users)
    # each asked for once, and the TinyLFU CPU tier admits by frequency: written all the same
    # (what to keep is the store's policy), once the disk has room
    assert written
    run_prompts(sched, sim, users * 3)
    assert store.sync()
    sim.kv.retire()
    stats = sim.kv.stats()
    assert written and len(written) == len(set(written)) == store.stats()["writes"]  # none twice
    assert stats["nvme_spilled_blocks"] == len(written) and stats["nvme_write_backlog"] == 0
    assert stats["cpu_blocks_staging"] == 1 and stats["cpu_blocks_used"] == 0  # an 8-block tier: one staging block


def test_a_swap_the_cpu_tier_has_room_for_only_with_its_staging_block_takes_it(tmp_path):
    """Two decodes outgrow 32 GPU blocks: the newer is preempted with 16 blocks of KV. A 16-block
    CPU tier with a store below keeps one of them to stage spills; the swap takes that block
    rather than be recomputed, and the spill takes it back once the sequence is back."""
    sim = make_kv(32, num_cpu_blocks=16, nvme_path=str(tmp_path))
    sched = make_scheduler(sim, "swap", max_num_batched_tokens=128)
    for rid, first in (("a", 0), ("b", 1000)):
        sched.add(make_seq(rid, range(first, first + 50), max_tokens=40))
    run_until_done(sched, sim)
    assert sched.num_preemptions == {"recompute": 0, "swap": 1} and sched.recomputed_for_cpu_room == 0
    assert sim.kv.offload.lower.store.sync()  # the spill's writes have finished: none holds a block
    sim.kv.retire()
    stats = sim.kv.stats()
    assert stats["nvme_staging_lent"] == 1
    assert stats["cpu_blocks_staging"] == 1 and stats["cpu_blocks_used"] == 0  # taken back
    assert sched.preempted_tokens["swap"] == 64


def store_prompts(path: str) -> None:
    """Four 9-token prompts (p0: tokens 0-8) computed by an engine whose LRU CPU tier writes
    every block to a store at `path`, then closed: a later engine there finds their blocks."""
    first = make_kv(4, num_cpu_blocks=4, nvme_path=path, cpu_policy="lru")
    sched = make_scheduler(first, "recompute")
    for i in range(4):
        sched.add(make_seq(f"p{i}", [i * 10 + j for j in range(9)], max_tokens=1))
        run_until_done(sched, first)
    first.kv.close()


def test_a_prefix_on_nvme_is_split_between_computing_and_loading(tmp_path):
    store_prompts(str(tmp_path))
    sim = make_kv(8, num_cpu_blocks=8, nvme_path=str(tmp_path))  # a restart on the same store
    sched = make_scheduler(sim, "recompute", BALANCED)
    seq = make_seq("q", list(range(9)), max_tokens=2)
    assert sim.kv.match_prefix(seq).num_lower == 2
    sched.add(seq)
    steps = run_until_done(sched, sim)
    # equal speeds: compute the first block while the second is read, then jump over it (a
    # step or more with nothing to run: the read, then the copy of the loaded block, land)
    chunks = [[(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] for out in steps]
    assert chunks[0] == [("q", 4)] and chunks[1] == []
    assert [c for c in chunks if c] == [[("q", 4)], [("q", 1)], [("q", 1)]]
    assert sched.loads.lower_prefix_blocks == {"load": 1, "compute": 1, "compute_for_queues": 0}
    assert sched.loaded_skipped_tokens == 4
    assert sim.kv.stats()["nvme_loaded_blocks"] == 1


@pytest.mark.parametrize("policy", ["fcfs", "ttft"])
def test_the_queue_ahead_of_a_load_counts_only_what_the_waiting_prompts_compute(tmp_path, policy):
    """A prompt waiting ahead whose prefix is resident on the GPU adds only its uncached tokens
    to the GPU queue a load is planned against: counted whole (33 ms here), it would have made
    reading both of q's blocks look free while q would then wait for the disk."""
    store_prompts(str(tmp_path))
    sim = make_kv(16, num_cpu_blocks=8, nvme_path=str(tmp_path))  # a restart on the same store
    sched = make_scheduler(sim, "recompute", BALANCED, scheduling_policy=policy)
    long_prompt = list(range(100, 132))  # 8 blocks, left cached on the GPU
    sched.add(make_seq("w", long_prompt, max_tokens=1))
    run_until_done(sched, sim)
    sched.add(make_seq("w2", [*long_prompt, 7], max_tokens=1))  # 1 token to compute
    q = make_seq("q", list(range(9)), max_tokens=2)
    assert sim.kv.match_prefix(q).num_lower == 2
    sched.add(q)
    run_until_done(sched, sim)
    # behind 1 ms of queue: compute one block (4 ms) while the other is read (4 ms)
    assert sched.loads.lower_prefix_blocks == {"load": 1, "compute": 1, "compute_for_queues": 0}


def test_a_swapped_sequence_shares_the_prefix_blocks_the_cpu_tier_holds(tmp_path):
    """Its full blocks already cached in the CPU tier are not copied again, and come back
    exactly on swap-in."""
    sim = make_kv(5, num_cpu_blocks=8, cpu_policy="lru")
    sched = make_scheduler(sim, "swap")
    prompt = list(range(1, 10))  # two full blocks, then one token
    run_prompts(sched, sim, [prompt, [50 + i for i in range(17)]])  # the second evicts (demotes) the first
    assert sim.kv.stats()["cpu_blocks_cached"] >= 2
    a, b = make_seq("a", prompt + [70, 71, 72], max_tokens=8), make_seq("b", range(81, 88), max_tokens=8)
    sched.add(b)
    sched.add(a)  # the newest: the one swapped out
    run_until_done(sched, sim)  # check_kv in every step: a's and b's KV exact throughout
    stats = sim.kv.stats()
    assert sched.num_preemptions["swap"] >= 1 and stats["cpu_shared_swap_blocks"] >= 1
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0


class SlowReads(SyncBackend):
    """The sync backend with every read taking `delay_s` (a disk slower than calibrated)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(threads=1)
        self.delay_s = delay_s

    def _run(self, req) -> None:
        if req.op == "read":
            time.sleep(self.delay_s)
        super()._run(req)


def test_a_disk_slower_than_calibrated_is_corrected_and_later_plans_compute_more(tmp_path):
    docs = [[d * 1000 + j for j in range(33)] for d in range(6)]  # 8 full blocks each
    first = make_kv(10, num_cpu_blocks=64, nvme_path=str(tmp_path), cpu_policy="lru")
    run_prompts(make_scheduler(first, "recompute"), first, docs)
    first.kv.reset_prefix_cache()  # demote every GPU block
    store = first.kv.offload.lower.store
    for _ in range(2000):  # spill-ahead writes the coldest (docs 0 and 1), a few at a time
        first.kv.retire()
        if store.stats()["writes"] >= 2 * 8:
            break
        time.sleep(0.005)
    first.kv.close()
    # calibrated: the disk reads a block in 1 ms, as fast as the GPU computes 1 token; it takes 30 ms
    calibrated = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 1e-3)
    sim = make_kv(64, num_cpu_blocks=64, nvme_path=str(tmp_path), backend=SlowReads(0.03))
    sched = make_scheduler(sim, "recompute", calibrated)
    loads = []
    for doc in docs:
        before = dict(sched.loads.lower_prefix_blocks)
        run_prompts(sched, sim, [doc])
        loads.append(sched.loads.lower_prefix_blocks["load"] - before["load"])
    assert loads[0] > 0 and loads[1] < loads[0]  # the first plan believed the calibration; the next the disk
    observed = sched.loads.observed_loads  # loads of one size: slower as a latency (or a rate), seen either way
    calibrated_s = 8 * BLOCK_BYTES / calibrated.disk_read_bytes_per_s
    assert observed.latency_s + 8 * BLOCK_BYTES / observed.bytes_per_s > 10 * calibrated_s


class Queued:
    """The GPU still computing `queued` prefill tokens, whatever the time, launched at once (a `GpuQueue`)."""

    def __init__(self, queued: int) -> None:
        self.queued = queued

    def tokens(self) -> int:
        return self.queued

    def launch_s(self, tokens: int) -> float:
        return 0.0


def long_and_short_on_a_held_disk(path: str):
    """A store holding a long prompt's 20 blocks and a short one's 2, reopened on a disk that
    holds every request (until `disk.release()`): (disk, sim, long_seq, short_seq)."""
    long_doc, short_doc = [1000 + j for j in range(81)], [2000 + j for j in range(9)]
    fillers = [[3000 + 100 * i + j for j in range(81)] for i in range(2)]  # they evict both docs from the GPU
    first = make_kv(22, num_cpu_blocks=64, nvme_path=path, cpu_policy="lru")
    run_prompts(make_scheduler(first, "recompute"), first, [long_doc, short_doc, *fillers])
    first.kv.close()  # the CPU tier written down
    disk = GatedBackend()
    sim = make_kv(64, num_cpu_blocks=64, nvme_path=path, backend=disk)
    disk.gate.clear()
    long_seq = make_seq("long", [*long_doc, 1], max_tokens=2)
    short_seq = make_seq("short", [*short_doc, 2], max_tokens=2)
    assert sim.kv.match_prefix(long_seq).num_lower == 20 and sim.kv.match_prefix(short_seq).num_lower == 2
    return disk, sim, long_seq, short_seq


@pytest.mark.parametrize("cost, given_up, where", [
    # its first block computed, the second planned to load (3.5 ms, under 90% of its 4 ms of
    # prefill): it reaches it running
    (CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 3.5e-3), 1, "running"),
    (CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 2e-3), 2, "waiting"),
])
def test_a_prompt_that_reaches_its_loads_early_computes_rather_than_wait_behind_others_reads(
    tmp_path, cost, given_up, where,
):
    """A short prompt's blocks were planned to load behind a long prompt's reads and prefill
    (so loading looked faster), but chunked prefill runs it beside that prefill: waiting would
    cost the whole read queue, computing its blocks 4 ms each. It computes and finishes while
    the disk holds every read; the long prompt, whose own reads are as fast as computing them,
    waits for them."""
    disk, sim, long_seq, short_seq = long_and_short_on_a_held_disk(str(tmp_path))
    try:
        sched = make_scheduler(sim, "recompute", cost)
        sched.add(long_seq)
        sched.add(short_seq)
        for _ in range(50):
            run_step(sched, sim)
            if short_seq.is_finished:
                break
        assert short_seq.is_finished and not long_seq.is_finished  # every read still held
        assert sched.loads.lower_prefix_blocks["load"] > given_up  # the long prompt loads too
        assert sim.kv.stats()["nvme_late_loads"] == given_up  # the short prompt's: the long one waits for its own
        assert sched.loads.stats()["nvme_late_requests"] == {"waiting": 0, "running": 0, where: 1}
    finally:
        disk.release()
    run_until_done(sched, sim)  # check_kv in every step: both exact
    assert long_seq.output_token_ids and sched.loaded_skipped_tokens > 0


def test_a_prompt_whose_reads_are_late_waits_for_them_while_others_wait_for_the_gpu(tmp_path):
    """The waiting case below, with six short prompts beside it, four of them left waiting for a
    sequence slot: computing the short prompt's two late blocks (8 ms) would delay each of them
    by as much, and together that costs more than waiting for the reads queued ahead (44 ms),
    which costs them nothing. It waits; nothing is given up while the disk holds every read
    (without counting the others, it computes them: the case below)."""
    cost = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 2e-3)
    disk, sim, long_seq, short_seq = long_and_short_on_a_held_disk(str(tmp_path))
    others = [make_seq(f"other{i}", [6000 + 10 * i + j for j in range(3)], max_tokens=100) for i in range(6)]
    try:
        sched = make_scheduler(sim, "recompute", cost, max_num_seqs=3)
        for seq in (long_seq, short_seq, *others):
            sched.add(seq)
        for _ in range(20):
            run_step(sched, sim)
        assert sum(s in sched.waiting for s in others) >= 4 and short_seq in sched.waiting
        assert sim.kv.stats()["nvme_late_loads"] == 0 and sched.load_waits > 0
    finally:
        disk.release()
    run_until_done(sched, sim)
    assert short_seq.output_token_ids and sched.loaded_skipped_tokens > 0


@pytest.mark.parametrize("cost, given_up, where", [
    (CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 3.5e-3), 1, "running"),
    (CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 2e-3), 2, "waiting"),
])
def test_a_prompt_that_reaches_its_loads_while_the_gpu_computes_before_them_waits_for_them(
    tmp_path, cost, given_up, where,
):
    """The cases above, with the GPU still computing 10 s of prefill it was given (the loop
    schedules ahead of the GPU through steps that sample nothing): computing the late blocks
    would start behind that, so the short prompt waits for its reads. Once the GPU is done,
    computing is faster again, and it computes them while the disk still holds the reads."""
    disk, sim, long_seq, short_seq = long_and_short_on_a_held_disk(str(tmp_path))
    gpu = Queued(10_000)
    try:
        sched = make_scheduler(sim, "recompute", cost)
        sched.launched = gpu
        sched.add(long_seq)
        sched.add(short_seq)
        for _ in range(20):
            run_step(sched, sim)
        assert not short_seq.is_finished and sched.load_waits > 0
        assert sim.kv.stats()["nvme_late_loads"] == 0
        gpu.queued = 0
        for _ in range(20):
            run_step(sched, sim)
            if short_seq.is_finished:
                break
        assert short_seq.is_finished and not long_seq.is_finished  # every read still held
        assert sim.kv.stats()["nvme_late_loads"] == given_up
        assert sched.loads.stats()["nvme_late_requests"] == {"waiting": 0, "running": 0, where: 1}
    finally:
        disk.release()
    run_until_done(sched, sim)


def test_prefills_ranked_after_a_sequence_that_waits_for_its_reads_wait_while_the_gpu_is_busy(tmp_path):
    """Under `ttft` the short prompt, ranked first, reaches its late read while the GPU still
    computes 10 s of prefill, and waits for it: a longer prompt ranked after it launches no
    chunk meanwhile (its chunks would run ahead of the short one's on the GPU). Once the GPU
    is done, it goes on."""
    cost = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 3.5e-3)
    disk, sim, long_seq, short_seq = long_and_short_on_a_held_disk(str(tmp_path))
    other = make_seq("other", [5000 + j for j in range(200)], max_tokens=2)
    gpu = Queued(10_000)
    try:
        sched = make_scheduler(sim, "recompute", cost, scheduling_policy="ttft")
        sched.launched = gpu
        for seq in (long_seq, short_seq, other):
            sched.add(seq)
        run_step(sched, sim)
        started = other.num_computed_tokens
        assert 0 < started < 200 and 0 < short_seq.num_computed_tokens < 9
        for _ in range(5):
            run_step(sched, sim)
        assert other.num_computed_tokens == started and sched.load_waits > 0
        gpu.queued = 0
        for _ in range(5):
            run_step(sched, sim)
        assert other.num_computed_tokens > started
    finally:
        disk.release()
    run_until_done(sched, sim)


def test_under_fcfs_prefills_after_a_sequence_that_waits_for_its_reads_wait_while_the_gpu_is_busy(tmp_path):
    """The case above in arrival order: the short prompt reaches its late read while the GPU
    still computes 10 s of prefill and waits for it; the prompt after it, running, launches no
    chunk meanwhile and the one that arrives then is not admitted, while a decode goes on. Once
    the GPU is done, they go on."""
    cost = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 3.5e-3)
    disk, sim, long_seq, short_seq = long_and_short_on_a_held_disk(str(tmp_path))
    other = make_seq("other", [5000 + j for j in range(200)], max_tokens=2)
    decode = make_seq("decode", [7000 + j for j in range(3)], max_tokens=50)
    late = make_seq("late", [8000 + j for j in range(20)], max_tokens=2)
    gpu = Queued(0)
    try:
        sched = make_scheduler(sim, "recompute", cost, max_num_batched_tokens=32)
        for seq in (decode, short_seq, other):
            sched.add(seq)
        for _ in range(3):
            run_step(sched, sim)
        assert decode.output_token_ids and 0 < other.num_computed_tokens < 200
        assert short_seq.num_computed_tokens < 9 and sched.load_waits > 0  # it waits for its reads
        gpu.queued, sched.launched = 10_000, gpu
        sched.add(late)
        started, decoded = other.num_computed_tokens, len(decode.output_token_ids)
        for _ in range(5):
            run_step(sched, sim)
        assert other.num_computed_tokens == started and late.num_computed_tokens == 0
        assert len(decode.output_token_ids) == decoded + 5
        gpu.queued = 0
        for _ in range(5):
            run_step(sched, sim)
        assert other.num_computed_tokens > started and late.num_computed_tokens > 0
    finally:
        disk.release()
    run_until_done(sched, sim)


@pytest.mark.parametrize("policy, queued", [("fcfs", 22), ("ttft", 2)])
def test_loads_are_planned_in_the_order_the_prompts_are_to_run(tmp_path, policy, queued):
    """Under `ttft` the short prompt, added after the long one, runs first: its loads are
    planned first and its reads lead the disk's queue. In arrival order (`fcfs`) they come
    behind the long prompt's 20. (A disk 4000x faster than the GPU: every block is loaded.)"""
    disk, sim, long_seq, short_seq = long_and_short_on_a_held_disk(str(tmp_path))
    fast_disk = CostModel(1e15, 1e15, prefill_s_per_token=1.0, disk_read_bytes_per_s=BLOCK_BYTES / 1e-3)
    try:
        sched = make_scheduler(sim, "recompute", fast_disk, scheduling_policy=policy)
        sched.add(long_seq)
        sched.add(short_seq)
        run_step(sched, sim)
        assert sched.loads.lower_prefix_blocks == {"load": 22, "compute": 0, "compute_for_queues": 0}
        assert sim.kv.late_reads(short_seq).queued == queued
    finally:
        disk.release()
    run_until_done(sched, sim)


def test_cpu_hits_are_recomputed_when_copying_them_in_is_slower():
    prompt = list(range(1, 18))  # four full blocks, then one token
    slow_pcie = CostModel(1e15, h2d_bytes_per_s=1.0, prefill_s_per_token=1e-3)
    for cost, copied in ((None, True), (slow_pcie, False)):
        sim = make_kv(6, num_cpu_blocks=8, cpu_policy="lru")
        sched = make_scheduler(sim, "recompute", cost)
        run_prompts(sched, sim, [prompt, [50 + i for i in range(21)]])  # the second evicts (demotes) the first
        hits = sim.kv.stats()["cpu_hit_blocks"]
        run_prompts(sched, sim, [prompt])
        assert (sim.kv.stats()["cpu_hit_blocks"] > hits) == copied
        assert (sched.loads.cpu_hits_recomputed > 0) == (not copied)


def test_under_ttft_a_swapped_out_prefill_takes_its_turn_and_holds_no_short_prompt_back():
    """a (24 tokens) and b (20) prefill side by side on 9 GPU blocks of 4 tokens; b's first decode
    finds none free and swaps a out with 16 tokens computed. A 3-token prompt arriving then
    ranks ahead of a's 8 tokens left: it runs at once, while a waits for its 6 blocks."""
    sim = make_kv(9, num_cpu_blocks=16)
    sched = make_scheduler(sim, "swap", max_num_batched_tokens=16, scheduling_policy="ttft",
                           max_prefill_chunk_tokens=8)
    a, b = make_seq("a", range(100, 124), max_tokens=4), make_seq("b", range(200, 220), max_tokens=4)
    sched.add(a)
    sched.add(b)
    while not sched.swapped:
        run_step(sched, sim)
    assert queues(sched) == ([], ["b"], ["a"]) and a.num_computed_tokens == 16
    c = make_seq("c", range(300, 303), max_tokens=2)
    sched.add(c)
    out = run_step(sched, sim)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("b", 1), ("c", 3)]
    assert queues(sched)[2] == ["a"]
    run_until_done(sched, sim)
    assert a.output_token_ids and sim.kv.stats()["gpu_blocks_used"] == 0


@pytest.mark.parametrize("policy", ["ttft", "hrrn"])
def test_a_swapped_out_decode_comes_back_at_once_however_long_its_context(policy):
    """Charged as a decode (one token), not as a prefill chunk over its whole context: with
    attention costing as much as a token per pair, a prefill's charge would exceed the budget."""
    sim = make_kv(16, num_cpu_blocks=16)
    cost = CostModel(d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15, prefill_s_per_token=1e-4,
                     prefill_s_per_token_sq=1e-4)
    sched = make_scheduler(sim, "swap", cost, max_num_batched_tokens=32, scheduling_policy=policy)
    s, r = make_seq("s", range(1, 21), max_tokens=3), make_seq("r", range(30, 34), max_tokens=30)
    sched.add(s)
    sched.add(r)
    while s.num_output_tokens == 0:
        run_step(sched, sim)
    sched.running.remove(s)
    sched._preempt(s)  # as a decode's allocation failure would
    assert queues(sched)[2] == ["s"]
    run_step(sched, sim)
    assert "s" not in queues(sched)[2] and not r.is_finished
    run_until_done(sched, sim)
    assert len(s.output_token_ids) == 3 and sim.kv.stats()["gpu_blocks_used"] == 0


def wait_until_idle(sim) -> None:
    """Book the lower tier's I/O until none is in flight (no read, write or staged copy)."""
    while sim.kv.offload.lower.busy:
        sim.kv.retire()
        time.sleep(0.001)


def test_a_prompt_whose_prefix_is_read_from_disk_is_admitted_only_with_room_for_all_of_it(tmp_path):
    """q (3 blocks) computes its first block while its second is read; once read, that block is
    copied in at once and its last follows. With room for its first chunk alone (2 blocks free
    beside a 6-block prompt) it would then push out sequences ranked after it, or compute what
    it read: it waits until its whole prompt fits. Meanwhile the disk is idle: it reads its first
    block too (a read-ahead), and is admitted with both as CPU hits."""
    store_prompts(str(tmp_path))
    sim = make_kv(8, num_cpu_blocks=8, nvme_path=str(tmp_path))  # a restart on the same store
    # the speeds pinned: a rate learned from q's load, timed on the wall clock, would make a
    # loaded machine's read look slow enough that the read-ahead no longer pays
    sched = make_scheduler(sim, "recompute", BALANCED, cost_model=BALANCED)
    other = make_seq("other", range(500, 522), max_tokens=6)  # 22 tokens: 6 blocks
    sched.add(other)
    run_step(sched, sim)
    q = make_seq("q", list(range(9)), max_tokens=2)
    sched.add(q)
    run_step(sched, sim)
    assert queues(sched)[:2] == (["q"], ["other"]) and sim.kv.tokens_to_load(q) == 4
    for _ in range(100):  # its read lands while it still waits; each step finds the disk idle
        if not sched.has_unfinished():
            break
        wait_until_idle(sim)  # (spills of other's blocks could be in flight: a busy disk reads nothing ahead)
        run_step(sched, sim)
    assert q.is_finished and other.is_finished and sched.loads.read_ahead_blocks == 1
    assert q.num_cached_tokens == 8 and sched.loaded_skipped_tokens == 0
    assert sched.num_preemptions == {"recompute": 0, "swap": 0}


def stored_document(path: str, num_blocks: int) -> list[int]:
    """A prompt of `num_blocks` full blocks and a token, computed by an engine whose LRU CPU tier
    took all of its blocks when a prompt as long pushed them out, then closed (written down)."""
    doc = [1000 + i for i in range(num_blocks * 4 + 1)]
    first = make_kv(num_blocks + 1, num_cpu_blocks=num_blocks + 4, nvme_path=path, cpu_policy="lru")
    sched = make_scheduler(first, "recompute")
    for i, prompt in enumerate([doc, [5000 + t for t in doc]]):
        sched.add(make_seq(f"p{i}", prompt, max_tokens=1))
        run_until_done(sched, first)
    first.kv.close()
    return doc


def kept_waiting(path: str, num_cpu_blocks: int, disk: GatedBackend | None = None, preemption: str = "recompute"):
    """q, a 12-block prompt stored at `path`, planned (its first 5 blocks computed, its last 7
    read) while "other" takes the one sequence slot, so q waits; with `disk`, its reads are
    held there. The simulated KV, the scheduler and q."""
    doc = stored_document(path, 12)
    sim = make_kv(32, num_cpu_blocks=num_cpu_blocks, nvme_path=path, backend=disk or "sync")
    sched = make_scheduler(sim, preemption, BALANCED, max_num_seqs=1, cost_model=BALANCED)  # speeds pinned (above)
    sched.add(make_seq("other", range(500, 503), max_tokens=40))
    run_step(sched, sim)
    q = make_seq("q", doc, max_tokens=2)
    sched.add(q)
    if disk is not None:
        disk.gate.clear()
    run_step(sched, sim)
    return sim, sched, q


@pytest.mark.parametrize("num_cpu_blocks, read_aheads, loaded", [(64, [3, 1, 1, 0], 12), (12, [2, 1, 0], 10)])
def test_a_prompt_kept_waiting_reads_ahead_what_it_planned_to_compute(tmp_path, num_cpu_blocks, read_aheads, loaded):
    """q's plan computes its first 5 blocks while its last 7 are read. The one sequence slot is
    taken, so q waits: never while a read is in flight, but each time the disk is idle, it
    splits what it was to compute again (behind an idle disk, the later blocks are read) until
    loading pays no more, and is admitted with its whole prefix read. In a small CPU tier each
    read-ahead takes half of the free blocks at most, the last blocks first, so what it loads
    stays one run: it computes its first two blocks and jumps over the other ten."""
    disk = GatedBackend()
    sim, sched, q = kept_waiting(str(tmp_path), num_cpu_blocks, disk)
    assert sim.kv.tokens_to_load(q) == 7 * 4
    run_step(sched, sim)  # its reads held: no read-ahead
    assert sched.loads.read_ahead_blocks == 0
    disk.release()
    seen = []
    for _ in read_aheads:
        wait_until_idle(sim)
        before = sched.loads.read_ahead_blocks
        run_step(sched, sim)
        seen.append(sched.loads.read_ahead_blocks - before)
    assert seen == read_aheads and q.status is SequenceStatus.WAITING
    assert sim.kv.tokens_to_load(q) == loaded * 4
    run_until_done(sched, sim)  # check_kv in every step: q's KV exact
    assert q.num_cached_tokens == loaded * 4 and sim.kv.stats()["nvme_loaded_blocks"] == loaded



def test_a_swap_out_takes_the_blocks_loaded_for_a_prompt_not_admitted_yet(tmp_path):
    """q waits for the one sequence slot, holding 10 of a 12-block CPU tier's blocks that its
    loads read; one more stages spills. "other", preempted with 10 blocks of KV, would have to
    be recomputed for want of room: it takes q's blocks instead (a swapped sequence comes back
    for certain, a load only maybe). q's plan is dropped; it is planned again when its turn
    comes, and both run to the end with their exact KV."""
    sim, sched, q = kept_waiting(str(tmp_path), 12, preemption="swap")
    lower = sim.kv.offload.lower
    other = sched.running[0]
    r = make_seq("r", range(700, 705), max_tokens=2)  # waits too; its plan (nothing on disk) holds nothing
    sched.add(r)
    while other.num_computed_tokens < 40:
        wait_until_idle(sim)  # q reads ahead while the disk is idle
        run_step(sched, sim)
    assert sim.kv.tokens_to_load(q) == 10 * 4 and sim.kv.offload.pool.num_free == 1
    assert sim.kv.cpu_free_blocks() == 12  # the free block, the staging block, q's ten
    sched.running.remove(other)
    sched._preempt(other)  # as a decode's allocation failure would
    assert queues(sched) == (["q", "r"], [], ["other"]) and sched.recomputed_for_cpu_room == 0
    assert not lower.planned(q.seq_id) and sim.kv.tokens_to_load(q) == 0
    assert lower.planned(r.seq_id)  # newer, but dropping its plan would free nothing
    assert sim.kv.stats()["nvme_plans_dropped_for_swaps"] == 1
    run_until_done(sched, sim)  # check_kv in every step: the KVs exact
    assert q.is_finished and other.is_finished and r.is_finished
    assert sched.num_preemptions == {"recompute": 0, "swap": 1}


def test_a_read_ahead_from_a_spoiled_store_costs_a_recompute(tmp_path):
    """The store's slots are spoiled after q's planned loads landed: its read-ahead reads fail
    their checksums. The blocks after them are of no use then (its loaded blocks are one run
    from the first it read ahead); q computes them, with exactly its own KV."""
    from tests.test_tier_faults import overwrite_slots

    sim, sched, q = kept_waiting(str(tmp_path), 64)
    wait_until_idle(sim)
    overwrite_slots(sim.kv.offload.lower.store, "garbage")
    run_step(sched, sim)
    assert sched.loads.read_ahead_blocks == 3
    for _ in range(100):  # each step finds the disk idle (its failed reads booked), as a read-ahead needs
        if not sched.has_unfinished():
            break
        wait_until_idle(sim)
        run_step(sched, sim)  # check_kv in every step: q's KV exact
    stats = sim.kv.stats()
    assert q.is_finished and stats["nvme_loaded_blocks"] == 7  # the plan's, before the damage
    assert stats["nvme_failed_loads"] == sched.loads.read_ahead_blocks == 5  # every read ahead (3, 1, then 1)
    assert q.num_cached_tokens + sched.loaded_skipped_tokens == 0


def test_a_read_ahead_the_store_misses_leaves_reads_given_up_before_alone(tmp_path):
    """q gave its planned reads up while they were still in flight. A read-ahead whose second
    block the store lacks lets its first read land unheld; the reads given up before are not
    stopped a second time (each counts once in what q waits for), and q runs with exact KV."""
    disk = GatedBackend()
    sim, sched, q = kept_waiting(str(tmp_path), 64, disk)
    lower = sim.kv.offload.lower
    lower.give_up(q.seq_id)  # its 7 reads still in flight, given up
    first, lost = sim.kv.keys.refs(q, 3, 5)
    assert lower.read_ahead(q.seq_id, (first, lost._replace(block_hash=1))) == 0
    assert not lower.arriving(q.seq_id) and lower.late_loads == 7
    disk.release()
    run_until_done(sched, sim)  # check_kv in every step: q's KV exact
    deadline = time.monotonic() + 10  # q computed what it gave up: those reads land on the I/O thread's time
    while lower.reads_in_flight and time.monotonic() < deadline:
        sim.kv.retire()
        time.sleep(0.001)
    assert q.is_finished and lower.reads_in_flight == 0

def test_a_waiting_prefix_being_loaded_counts_in_the_gpu_queue_by_what_it_computes(tmp_path):
    """A waiting sequence whose lower-tier loads started ahead of its turn (prefetched while no
    sequence slot is free) is counted in the GPU queue that later loads are planned against by
    the tokens it will compute: the prefix being read is not GPU work."""
    store_prompts(str(tmp_path))
    sim = make_kv(8, num_cpu_blocks=8, nvme_path=str(tmp_path))  # a restart on the same store
    sched = make_scheduler(sim, "recompute", BALANCED, max_num_seqs=1, scheduling_policy="ttft")
    first, q = make_seq("first", range(50, 53), max_tokens=4), make_seq("q", list(range(9)), max_tokens=2)
    sched.add(first)
    sched.add(q)
    run_step(sched, sim)
    assert q in sched.waiting and sim.kv.tokens_to_load(q) > 0
    assert sched.ranking.to_compute(q) == q.num_tokens - sim.kv.tokens_to_load(q)
    run_until_done(sched, sim)
    assert q.is_finished and sim.kv.tokens_to_load(q) == 0


def test_a_prefix_split_between_computing_and_loading_is_ranked_by_all_it_has_left(tmp_path):
    """While q computes its first block and reads its second, it has 1 token to compute (its
    last): the GPU queue that loads are planned against counts that one. It is ranked by its
    whole rest, 5 tokens, as it would be without the lower tier: a 3-token prompt arriving then
    goes first (ranked by the 1 token, q jumped the prompts its reads were planned behind, and
    they waited while it waited for its reads)."""
    store_prompts(str(tmp_path))
    sim = make_kv(8, num_cpu_blocks=8, nvme_path=str(tmp_path))  # a restart on the same store
    sched = make_scheduler(sim, "recompute", BALANCED)
    q = make_seq("q", list(range(9)), max_tokens=2)
    sched.add(q)
    out = run_step(sched, sim)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(q, 4)]  # the first block, computed
    assert sim.kv.tokens_to_load(q) == 4  # the second, read
    assert sched.ranking.to_compute(q) == 1
    assert sched._prefill_backlog() == 1  # the queue a load is planned against, too
    r = make_seq("r", range(60, 63), max_tokens=2)
    sched.add(r)
    assert [(q, r)[i] for i in sched.ranking.share([q, r], 16, None).order] == [r, q]
    run_until_done(sched, sim)
    assert sim.kv.tokens_to_load(q) == 0 and sched.loaded_skipped_tokens == 4 and r.is_finished


@pytest.mark.parametrize("decoding", [True, False])
def test_a_prompt_whose_loads_land_without_room_for_its_rest_waits_for_it_while_another_decodes(
    tmp_path, decoding,
):
    """q (10 tokens, 3 blocks) was admitted with room for its whole prompt and computes its
    first block while its second is read; r, ranked after it, is admitted meanwhile and takes
    that room. When q's read lands, one block is free for q's two. While d decodes (its blocks
    come back when it finishes), q waits for the room, its read block kept in the CPU tier: r
    finishes in the room, and q jumps over its block. Before q waited for room, r took the free
    block and q computed what it read. With nothing decoding, no block comes back unasked,
    and q does not wait: it computes the block it read, as before."""
    store_prompts(str(tmp_path))
    disk = GatedBackend()
    # a restart on the same store; d's blocks (2) and r's first chunk (4) leave one free
    sim = make_kv(8 if decoding else 6, num_cpu_blocks=8, nvme_path=str(tmp_path), backend=disk)
    disk.gate.clear()
    sched = make_scheduler(sim, "recompute", BALANCED, max_num_batched_tokens=16, scheduling_policy="ttft")
    d = make_seq("d", range(700, 704), max_tokens=12)
    q = make_seq("q", [*range(9), 99], max_tokens=2)
    r = make_seq("r", range(800, 820), max_tokens=1)
    try:
        if decoding:
            sched.add(d)
            run_step(sched, sim)
        sched.add(q)
        run_step(sched, sim)
        assert q.num_computed_tokens == 4 and sim.kv.tokens_to_load(q) == 4
        sched.add(r)
        run_step(sched, sim)
        assert queues(sched)[1] == ["d", "q", "r"][1 - decoding:] and r.num_computed_tokens > 0
        assert sim.kv.stats()["gpu_blocks_used"] == sim.kv.stats()["gpu_blocks_total"] - 1
    finally:
        disk.release()
    deadline = time.monotonic() + 10
    while sim.kv.lower_reads_in_flight() and time.monotonic() < deadline:
        sim.kv.retire()  # books the finished read, as a step begins by doing
        time.sleep(0.001)
    assert not sim.kv.lower_reads_in_flight()
    run_step(sched, sim)
    if decoding:
        assert q.num_computed_tokens == 4 and r.is_finished and not d.is_finished
    run_until_done(sched, sim)
    assert all(s.is_finished for s in (d, q, r)[1 - decoding:])
    assert sched.loaded_skipped_tokens == (4 if decoding else 0)
    assert sched.num_preemptions == {"recompute": 0, "swap": 0}


@pytest.mark.parametrize("policy", ["ttft", "fcfs"])
def test_no_prompt_is_admitted_after_one_whose_loads_wait_for_room(policy):
    """While a running prompt's loads wait for room for the rest of it (`Landed.short`, as the
    manager answers above), a prompt ranked after it (or, under `fcfs`, arriving after it) is
    not admitted, though it fits: it would take the blocks coming back, and under a stream of
    such prompts the first would starve. Once the room is there, they go on."""
    sim = make_kv(16, num_cpu_blocks=8)
    sched = make_scheduler(sim, "recompute", max_num_batched_tokens=8, scheduling_policy=policy)
    d, q = make_seq("d", range(700, 703), max_tokens=20), make_seq("q", range(100, 112), max_tokens=2)
    sched.add(d)
    run_step(sched, sim)
    sched.add(q)
    run_step(sched, sim)
    assert 0 < q.num_computed_tokens < 12 and d.output_token_ids
    m = make_seq("m", range(300, 316), max_tokens=2)  # ranked after q, and after it in arrival
    sched.add(m)
    land = sim.kv.land_loads
    sim.kv.land_loads = lambda seq, wait_for_room=False: Landed(short=True) if seq is q else land(seq, wait_for_room)
    computed = q.num_computed_tokens
    for _ in range(3):
        run_step(sched, sim)
    assert q.num_computed_tokens == computed and m in sched.waiting and m.num_computed_tokens == 0
    sim.kv.land_loads = land
    run_until_done(sched, sim)
    assert q.is_finished and m.is_finished
