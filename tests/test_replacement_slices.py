"""benchmarks/bench_replay.py's held-out slice summary: adaptive's margin over the better of LRU
and TinyLFU per slice, and the worst (with its slice's seed) and mean of it over slices."""

from __future__ import annotations

from pathlib import Path

import pytest

from tieredkv.cache.trace import ReplayResult

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_replay

    return bench_replay


def results(lru: int, tinylfu: int, adaptive: int) -> dict[str, ReplayResult]:
    """Hits of 200 requested blocks under each online policy."""
    hits = {"lru": lru, "tinylfu": tinylfu, "adaptive": adaptive}
    return {p: ReplayResult(200, n, n) for p, n in hits.items()}


def test_margin_is_adaptive_minus_the_better_of_lru_and_tinylfu(bench):
    assert bench.margin(results(lru=50, tinylfu=20, adaptive=44)) == pytest.approx(-0.03)
    assert bench.margin(results(lru=10, tinylfu=90, adaptive=92)) == pytest.approx(0.01)


def test_slice_row_names_the_worst_slice_and_the_mean_margin(bench):
    slices = [results(50, 20, 50), results(10, 90, 84), results(30, 30, 32)]  # margins 0, -3, +1 points
    row = bench.slice_row("mooncake synthetic", 16, [7, 8, 9], slices)
    # mean hit rates 15.0 / 23.3 / 27.7 %, the worst margin -3.0 (seed 8), the mean -0.7
    assert row.split() == ["mooncake", "synthetic", "16", "GiB", "15.0", "23.3", "27.7", "-3.0", "(seed", "8)", "-0.7"]


def test_multi_turn_slices_differ_by_arrival_seed_only(bench):
    config = ROOT / "configs" / "multi_turn_8b.yaml"
    default, gpu_blocks = bench.multi_turn_requests(config, 1.0)
    assert bench.multi_turn_requests(config, 1.0, seed=0)[0] == default  # the config's seed is 0
    other = bench.multi_turn_requests(config, 1.0, seed=1)[0]
    assert other != default and sorted(other) == sorted(default) and gpu_blocks == 2048


def test_slice_row_judges_every_policy_beside_lru_and_tinylfu(bench):
    def judged(arc: int, wtinylfu: int) -> dict[str, ReplayResult]:
        found = results(lru=50, tinylfu=20, adaptive=50)
        return found | {"arc": ReplayResult(200, arc, arc), "wtinylfu": ReplayResult(200, wtinylfu, wtinylfu)}

    row = bench.slice_row("multi_turn_8b", 8, [3, 4], [judged(arc=52, wtinylfu=30), judged(arc=40, wtinylfu=50)])
    # means 25.0 / 10.0 / 25.0 / 23.0 / 20.0 %; then adaptive, arc (worst -5.0 at seed 4, mean
    # -2.0) and wtinylfu (worst -10.0 at seed 3, mean -5.0), each against LRU's 25%
    assert row.split()[3:] == ["25.0", "10.0", "25.0", "23.0", "20.0",
                               "+0.0", "(seed", "3)", "+0.0", "-5.0", "(seed", "4)", "-2.0",
                               "-10.0", "(seed", "3)", "-5.0"]
