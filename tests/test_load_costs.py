"""What a lower-tier load (disk or remote) costs the plan: a fixed latency beside its bytes over
the read rate, learned from completed loads; a split that does not save enough computes."""

from __future__ import annotations

import pytest

from tieredkv.policy import LOAD_MARGIN, CostModel, ObservedLoads, split_lower_prefix

# 1 ms of prefill a token (4 ms a block of 4 tokens); 3 ms to read a block of 1 byte (a read
# alone saves a quarter of a block's prefill); PCIe free
BALANCED = CostModel(d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15, prefill_s_per_token=1e-3,
                     disk_read_bytes_per_s=1 / 3e-3)


def with_latency(latency_s: float) -> CostModel:
    return CostModel(1e15, 1e15, prefill_s_per_token=1e-3, disk_read_bytes_per_s=1 / 3e-3, read_latency_s=latency_s)


@pytest.mark.parametrize(
    "latency_ms, computed",
    [
        (0, 4),  # max(16, 18) = 18 ms computing 4 blocks while 6 load, against 40 ms computing all 10
        (8, 5),  # max(20, 8 + 15) = 23 ms (6 blocks: max(24, 20) = 24)
        (18, 7),  # max(28, 18 + 9) = 28 ms (6 blocks: max(24, 30) = 30)
        (34, 10),  # loading 1 block: max(36, 34 + 3) = 37 ms saves 3 of 40 ms: under the margin
        (1000, 10),
    ],
)
def test_a_load_pays_its_latency_before_its_first_block(latency_ms, computed):
    assert split_lower_prefix(10, 1, 0, 4, with_latency(latency_ms / 1e3)) == computed


def test_without_the_margin_a_close_call_would_have_loaded():
    """34 ms of latency: loading the last block finishes at 37 ms, computing all at 40 ms."""
    assert 1 - 37 / 40 < LOAD_MARGIN
    assert split_lower_prefix(10, 1, 0, 4, with_latency(0.034)) == 10
    assert split_lower_prefix(10, 1, 0, 4, with_latency(0.030)) == 9  # max(36, 33): saves 10%


def test_the_latency_waits_behind_the_queue_of_reads():
    # 4 blocks queued ahead (12 ms) and 8 ms of latency: max(4c, 20 + 3 (10 - c)) -> c = 7, 29 ms
    assert split_lower_prefix(10, 1, 0, 4, with_latency(0.008), lower_queue_bytes=4) == 7


def test_loads_of_one_size_teach_the_latency_and_keep_the_calibrated_rate():
    """A remote tier 20 ms away: each 1 MB load at 1 GB/s takes 21 ms, not the 1 ms the probe's
    rate alone says."""
    loads = ObservedLoads(rate=1e9)
    for _ in range(20):
        loads.add(1_000_000, 0.021)
    assert loads.latency_s + 1_000_000 / loads.bytes_per_s == pytest.approx(0.021, rel=0.01)
    assert loads.latency_s == pytest.approx(0.020, rel=0.05)  # one size cannot tell more apart:
    assert loads.bytes_per_s == pytest.approx(1e9, rel=0.3)  # the calibrated point keeps the rate near


def test_loads_of_several_sizes_teach_both_the_latency_and_the_rate():
    loads = ObservedLoads(rate=10e9, latency_s=0.0)  # truth: 5 ms and 0.5 GB/s
    for size in (1_000_000, 50_000_000) * 10:
        loads.add(size, 0.005 + size / 0.5e9)
    assert loads.latency_s == pytest.approx(0.005, rel=0.15)  # the calibrated point pulls a little
    assert loads.bytes_per_s == pytest.approx(0.5e9, rel=0.05)


def test_a_large_load_faster_than_a_small_one_keeps_the_calibrated_rate():
    loads = ObservedLoads(rate=1e9)
    loads.add(1_000_000, 0.050)
    loads.add(100_000_000, 0.010)  # noise: the fit would slope down
    assert loads.bytes_per_s > 0 and loads.latency_s >= 0


def test_after_loads_that_stalled_a_quiet_while_brings_the_calibrated_figures_back():
    """Loads given up after 10 s (a disk that hung) make the fit say that no load pays, so none
    is tried again: after `QUIET_S` with no load seen, the calibrated figures hold again."""
    loads = ObservedLoads(rate=1.5e9, latency_s=0.001)
    loads.age(0.0)
    for size in (32 << 20, 128 << 20) * 5:
        loads.add(size, 0.001 + size / 1.5e9)
    loads.add(64 << 20, 10.0)
    loads.add(32 << 20, 10.0)
    loads.age(1.0)  # the loads of this step were seen
    assert loads.latency_s > 1.0  # no prefix load pays at this latency
    loads.age(1.0 + ObservedLoads.QUIET_S - 0.1)
    assert loads.latency_s > 1.0
    loads.age(1.0 + ObservedLoads.QUIET_S)
    assert (loads.bytes_per_s, loads.latency_s) == (1.5e9, 0.001)
    took = 0.001 + (32 << 20) / 0.5e9
    loads.add(32 << 20, took)  # learning starts again from the calibrated point
    assert loads.latency_s + (32 << 20) / loads.bytes_per_s == pytest.approx(took, rel=0.1)


def test_loads_seen_now_and_then_keep_what_was_learned():
    loads = ObservedLoads(rate=10e9)
    for step in range(100):  # a 1 GB/s tier, a load every 20 s
        size = (50_000_000, 200_000_000)[step % 2]
        loads.add(size, size / 1e9)
        loads.age(step * 20.0)
    assert loads.bytes_per_s == pytest.approx(1e9, rel=0.1)


def test_a_negative_read_latency_is_refused():
    with pytest.raises(ValueError, match="cost_model.read_latency_s"):
        CostModel(1e9, 1e9, 1e-4, read_latency_s=-0.001)


def test_a_busy_gpu_does_not_hide_what_loading_saves():
    """1 s of prefill queued ahead: loading all 10 blocks saves their 40 ms of compute, a
    share of the request's own work, not of the queue."""
    assert split_lower_prefix(10, 1, 0, 4, with_latency(0.008), gpu_queue_tokens=1000) == 0
