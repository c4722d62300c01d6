"""The swap-vs-recompute policy as a pure function of a cost model."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tieredkv.policy import (
    LOAD_MARGIN,
    CostModel,
    ObservedLoads,
    TierPolicy,
    choose_preemption,
    first_paying_block,
    promote_cpu_hits,
    split_lower_prefix,
    wait_for_late_reads,
)

COSTS = CostModel(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, prefill_s_per_token=1e-4, prefill_s_per_token_sq=1e-8)
MIB = 1 << 20


@pytest.mark.parametrize(
    "mode, tokens, blocks, cpu_free, expected",
    [
        # 64 tokens: recompute 6.4 ms + tiny; swap of 4 blocks of 1 MiB: 8.4 ms -> recompute
        ("auto", 64, 4, 100, "recompute"),
        # 8k tokens: recompute 0.82 s + 0.67 s; swap of 512 MiB: 1.07 s -> swap
        ("auto", 8192, 512, 1000, "swap"),
        ("auto", 8192, 512, 511, "recompute"),  # CPU tier full
        ("swap", 64, 4, 100, "swap"),
        ("swap", 64, 4, 3, "recompute"),
        ("recompute", 8192, 512, 1000, "recompute"),
    ],
)
def test_policy_with_scripted_costs(mode, tokens, blocks, cpu_free, expected):
    assert choose_preemption(mode, tokens, blocks, 1 << 20, cpu_free, COSTS) == expected


def test_auto_without_cost_model_recomputes():
    assert choose_preemption("auto", 8192, 512, 1 << 20, 10_000, None) == "recompute"


# per token 1 ms of prefill; per block of 4 tokens 4 ms from disk: equal speeds
BALANCED = CostModel(d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15, prefill_s_per_token=1e-3,
                     disk_read_bytes_per_s=1 / 4e-3)


# the disk twice as fast: 2 ms a block
FAST_DISK = replace(BALANCED, disk_read_bytes_per_s=1 / 2e-3)


def test_a_shared_disk_makes_later_requests_compute_more():
    alone = split_lower_prefix(10, 1, 0, 4, FAST_DISK)
    behind_reads = split_lower_prefix(10, 1, 0, 4, FAST_DISK, lower_queue_bytes=6)  # 6 blocks queued
    assert (alone, behind_reads) == (3, 5)
    assert split_lower_prefix(10, 1, 0, 4, FAST_DISK, lower_queue_bytes=1000) == 10  # never arrives in time


def test_behind_a_queue_a_block_whose_load_alone_does_not_beat_computing_it_is_computed():
    """At equal speeds, loading half the prefix while computing the other half finishes in half
    the time, but no block's load saves anything on its own: behind other reads or other
    prefill all are computed; with both queues empty the overlap is the request's to take."""
    assert split_lower_prefix(10, 1, 0, 4, BALANCED, gpu_queue_tokens=1) == 10
    assert split_lower_prefix(10, 1, 0, 4, BALANCED, lower_queue_bytes=0.001) == 10
    assert split_lower_prefix(10, 1, 0, 4, BALANCED) == 5


def test_with_attention_only_the_deeper_blocks_pay():
    """With attention (1e-5 s a (query, key) pair) a block's prefill grows with its depth: from
    the second block on, the load (4 ms) saves 10% of it; the first is computed."""
    deep = replace(BALANCED, prefill_s_per_token_sq=1e-5)
    assert first_paying_block(40, 4e-3, 0, 4, deep) == 1
    assert first_paying_block(40, 4e-3, 40, 4, deep) == 0
    assert first_paying_block(40, 4e-3, 0, 4, BALANCED) == 40
    assert split_lower_prefix(40, 1, 0, 4, deep, gpu_queue_tokens=1) == 15  # the split among the blocks that pay


def test_a_busy_gpu_makes_loading_pay():
    """Blocks that land before the GPU gets to the request cost it nothing: loaded, even where
    their loads alone would not pay."""
    assert split_lower_prefix(10, 1, 0, 4, BALANCED, gpu_queue_tokens=24) == 4  # 24 ms of prefill ahead: 6 land
    assert split_lower_prefix(10, 1, 0, 4, BALANCED, gpu_queue_tokens=40) == 0


def test_a_disk_faster_than_compute_loads_everything():
    fast = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=1e15)
    assert split_lower_prefix(10, 1, 0, 4, fast, lower_queue_bytes=100, gpu_queue_tokens=0) == 0


def test_loaded_blocks_arrive_before_the_gpu_would_have_computed_the_first_of_them():
    """Whatever the queues and speeds, a plan never has a request wait for a load that ends
    after the compute it replaces would have: the last loaded block lands no later than the
    GPU, computing on, would have finished the first one loaded."""
    rng = random.Random(0)
    for _ in range(2000):
        cost = CostModel(1e15, rng.uniform(0.5, 50.0), prefill_s_per_token=rng.uniform(1e-4, 1e-2),
                         prefill_s_per_token_sq=rng.choice([0.0, 1e-6]), disk_read_bytes_per_s=rng.uniform(0.5, 50.0))
        n, first = rng.randrange(1, 40), 4 * rng.randrange(0, 20)
        lower_queue, gpu_queue = rng.uniform(0, 20), rng.randrange(0, 200)
        c = split_lower_prefix(n, 1, first, 4, cost, lower_queue, gpu_queue)
        if c == n:
            continue
        per_block = 1 / cost.disk_read_bytes_per_s + 1 / cost.h2d_bytes_per_s
        loads_land = lower_queue / cost.disk_read_bytes_per_s + (n - c) * per_block
        gpu_reaches = cost.recompute_s(gpu_queue) + cost.recompute_s(first + (c + 1) * 4) - cost.recompute_s(first)
        assert loads_land <= gpu_reaches + 1e-9


def test_the_observed_read_rate_corrects_a_wrong_calibration_within_a_few_loads():
    loads = ObservedLoads(rate=10e9)  # calibrated 10 GB/s; the tier gives 1 GB/s, no latency
    for size in (10 << 20, 100 << 20) * 5:
        loads.add(size, size / 1e9)
    assert loads.bytes_per_s == pytest.approx(1e9, rel=0.1)
    assert loads.latency_s < 0.005  # against loads of 10 to 100 ms


def test_nvme_plans_use_the_observed_loads_over_the_calibrated_ones():
    policy = TierPolicy("recompute", block_bytes=1, block_size=4, cost=FAST_DISK)
    fast, slow = ObservedLoads(1e15), ObservedLoads(1 / 40e-3)
    assert policy.lower_blocks_to_compute(10, 0) == 3
    assert policy.lower_blocks_to_compute(10, 0, observed=fast) == 0
    assert policy.lower_blocks_to_compute(10, 0, observed=slow) == 10


def test_cpu_hits_are_copied_in_unless_the_pcie_queue_makes_recompute_faster():
    cost = CostModel(1e15, h2d_bytes_per_s=1e6, prefill_s_per_token=1e-3)  # 1 MB/s; 4 ms a block of 4 tokens
    assert promote_cpu_hits(10, 1000, 0, 4, cost)  # 10 ms of copies against 40 ms of prefill
    assert not promote_cpu_hits(10, 1000, 0, 4, cost, h2d_queue_bytes=40_000)  # 40 ms queued ahead
    assert promote_cpu_hits(10, 1000, 0, 4, None)


def _split_by_scan(num_blocks, block_bytes, first_token, block_size, cost, lower_queue_bytes, gpu_queue_tokens):
    """`split_lower_prefix` by trying every split (the reference for its bisection)."""
    per_block = block_bytes / cost.disk_read_bytes_per_s + block_bytes / cost.h2d_bytes_per_s
    load_wait = cost.read_latency_s + lower_queue_bytes / cost.disk_read_bytes_per_s

    def finish_s(c):
        load = load_wait + (num_blocks - c) * per_block if c < num_blocks else 0.0
        return max(cost.recompute_s(gpu_queue_tokens) + cost.extend_s(first_token, c * block_size), load)

    def pays_alone(i):
        return per_block <= (1 - LOAD_MARGIN) * cost.extend_s(first_token + i * block_size, block_size)

    gpu_wait = cost.recompute_s(gpu_queue_tokens)
    first_paying = next((i for i in range(num_blocks) if pays_alone(i)), num_blocks)
    in_time = next((c for c in range(num_blocks + 1)
                    if c == num_blocks or load_wait + (num_blocks - c) * per_block <= gpu_wait + 1e-12), num_blocks)
    alone = lower_queue_bytes == 0 and gpu_queue_tokens == 0  # the overlap costs no other request
    best = min(range(0 if alone else min(first_paying, in_time), num_blocks + 1), key=finish_s)
    margin = LOAD_MARGIN * cost.extend_s(first_token, num_blocks * block_size)
    return best if finish_s(best) <= finish_s(num_blocks) - margin else num_blocks


def test_the_split_found_by_bisection_is_the_best_of_every_split():
    rng = random.Random(0)
    for _ in range(3000):
        cost = CostModel(rng.choice([1e9, 5e10, 1e15]), rng.choice([1e9, 5e10, 1e15]),
                         rng.choice([0.0, 1e-6, 2e-5, 1e-3]), rng.choice([0.0, 6e-10, 1e-7]),
                         rng.choice([1e3, 1e6, 1.5e9, 1e12]), rng.choice([0.0, 1e-3, 0.05]))
        args = (rng.randint(0, 300), rng.choice([1, 8192, 2 << 20]), rng.randint(0, 60000), rng.choice([4, 16, 128]),
                cost, rng.choice([0, 10 << 20, 1 << 30]), rng.choice([0, 100, 8192, 50000]))
        assert split_lower_prefix(*args) == _split_by_scan(*args), args


def test_a_sequence_waits_for_late_reads_unless_computing_their_blocks_is_clearly_faster():
    """1 MiB blocks read at 1 GB/s and copied in at 1 GB/s (1.05 ms each way), 16 tokens
    computed in 3.2 ms (+ attention)."""
    disk = CostModel(1e9, 1e9, prefill_s_per_token=2e-4, prefill_s_per_token_sq=1e-8, disk_read_bytes_per_s=1e9)

    def wait(num_blocks, queued_blocks, gpu_queue_tokens=0, cost=disk, launch_s=0.0, num_delayed=0):
        return wait_for_late_reads(num_blocks, MIB, 0, 16, cost, queued_blocks * MIB, gpu_queue_tokens, launch_s,
                                   num_delayed)

    assert wait(4, 4)  # its own reads only: they land before the GPU would have computed them
    assert not wait(4, 40)  # 36 reads queued ahead of them (someone else's plan): computing wins
    assert wait(4, 40, gpu_queue_tokens=200)  # unless the GPU is as far behind (40 ms against 46)
    # or computing them (12.8 ms) would delay three other prefills as much (51 ms against 46), not two
    assert wait(4, 40, num_delayed=3) and not wait(4, 40, num_delayed=2)
    # but the loop launches the next chunk after the reads if it waits, beside the queue if not
    assert not wait(4, 40, gpu_queue_tokens=200, launch_s=0.03)
    assert wait(4, 4, launch_s=0.03)  # with nothing queued on the GPU the launch delays both alike
    assert wait(4, 400, cost=COSTS)  # no read rate known: it waits
    prefill_s = disk.extend_s(0, 4 * 16)
    at = 4 * MIB / 1e9  # the copy in
    tie = int((prefill_s - at) * 1e9 / MIB)  # queued blocks whose reads take as long as computing
    assert wait(4, tie) and wait(4, int(tie * (1 + LOAD_MARGIN)) - 1)  # computing must save the margin
    assert not wait(4, int(tie * (1 + LOAD_MARGIN)) + 2)
