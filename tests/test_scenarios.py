"""Scheduler + KV cache manager scenarios with no model: scripted steps through
`Scheduler.update`, exact block ids, queues and tier moves. Every step also checks that each
scheduled sequence reads back exactly its own tokens' KV (tests/kv_factory.py)."""

from __future__ import annotations

from tests.kv_factory import BLOCK_BYTES, make_kv, make_scheduler, make_seq, run_step, run_until_done
from tieredkv.policy import CostModel

SWAP_WINS = CostModel(d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15, prefill_s_per_token=1.0)
RECOMPUTE_WINS = CostModel(d2h_bytes_per_s=1.0, h2d_bytes_per_s=1.0, prefill_s_per_token=1e-9)


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


def cpu_contents(sim) -> list[int]:
    """First token of each unowned CPU block's content, next to evict first (None: empty)."""
    return [b.token_ids and b.token_ids[0] for b in sim.kv.offload.pool.free_blocks()]


def test_gpu_evictions_demote_least_recent_first_and_the_cpu_tier_spills_its_coldest(tmp_path):
    sim = make_kv(4, num_cpu_blocks=4, nvme_path=str(tmp_path))
    sched = make_scheduler(sim, "recompute")
    firsts = []
    for i in range(4):  # 9-token prompts: two full blocks each, cached when done
        sched.add(make_seq(f"p{i}", [i * 10 + j for j in range(9)], max_tokens=1))
        run_until_done(sched, sim)
        sim.kv.retire()  # the demotions of the last step have finished
        firsts.append(cpu_contents(sim))
    assert firsts[0] == [None] * 4
    # p1 evicted p0's second block (released first); p2 its first and p1's second, p3 ...
    assert firsts[1] == [None, None, None, 4]
    assert firsts[2] == [None, 4, 0, 14]
    assert firsts[3] == [0, 14, 10, 24]
    store = sim.kv.offload.nvme.store
    assert store.sync()  # the writes spill-ahead started have finished
    spilled = [b.block_hash for b in sim.kv.offload.pool.free_blocks() if store.contains(b.block_hash)]
    coldest = [b.block_hash for b in sim.kv.offload.pool.free_blocks()][: len(spilled)]
    assert spilled and spilled == coldest  # written ahead from the eviction end


def test_a_prefix_on_nvme_is_split_between_computing_and_loading(tmp_path):
    balanced = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=BLOCK_BYTES / 4e-3)
    first = make_kv(4, num_cpu_blocks=4, nvme_path=str(tmp_path))
    sched = make_scheduler(first, "recompute")
    for i in range(4):
        sched.add(make_seq(f"p{i}", [i * 10 + j for j in range(9)], max_tokens=1))
        run_until_done(sched, first)
    first.kv.close()
    sim = make_kv(8, num_cpu_blocks=8, nvme_path=str(tmp_path))  # a restart on the same store
    sched = make_scheduler(sim, "recompute", balanced)
    seq = make_seq("q", list(range(9)), max_tokens=2)
    assert len(sim.kv.match_prefix(seq).nvme_refs) == 2
    sched.add(seq)
    steps = run_until_done(sched, sim)
    # equal speeds: compute the first block while the second is read, then jump over it (a
    # step or more with nothing to run: the read, then the copy of the loaded block, land)
    chunks = [[(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] for out in steps]
    assert chunks[0] == [("q", 4)] and chunks[1] == []
    assert [c for c in chunks if c] == [[("q", 4)], [("q", 1)], [("q", 1)]]
    assert sched.nvme_prefix_blocks == {"load": 1, "compute": 1} and sched.nvme_skipped_tokens == 4
    assert sim.kv.stats()["nvme_loaded_blocks"] == 1
