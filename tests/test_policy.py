"""The swap-vs-recompute policy as a pure function of a cost model."""

from __future__ import annotations

import pytest

from tieredkv.policy import CostModel, choose_preemption, split_nvme_prefix

COSTS = CostModel(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, prefill_s_per_token=1e-4, prefill_s_per_token_sq=1e-8)


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


def test_a_shared_disk_makes_later_requests_compute_more():
    alone = split_nvme_prefix(10, 1, 0, 4, BALANCED)
    behind_reads = split_nvme_prefix(10, 1, 0, 4, BALANCED, disk_queue_bytes=6)  # 6 blocks queued
    assert (alone, behind_reads) == (5, 8)
    assert split_nvme_prefix(10, 1, 0, 4, BALANCED, disk_queue_bytes=1000) == 10  # never arrives in time


def test_a_busy_gpu_makes_loading_pay():
    assert split_nvme_prefix(10, 1, 0, 4, BALANCED, gpu_queue_tokens=24) == 2  # 24 ms of prefill ahead


def test_a_disk_faster_than_compute_loads_everything():
    fast = CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=1e15)
    assert split_nvme_prefix(10, 1, 0, 4, fast, disk_queue_bytes=100, gpu_queue_tokens=0) == 0
