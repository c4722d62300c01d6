"""The clairvoyant tail bound of bench_scheduling --bound (benchmarks/tail_bound.py): EDF
feasibility on hand-built jobs, the least tail with one request let past it, and how many
requests the nearest-rank p99 leaves above it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tieredkv.experiment.metrics import percentile

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bound(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("tail_bound")


def test_feasible_preempts_for_the_earlier_deadline(bound):
    """A 2 s job at 0 and a 1 s job at 1: the second preempts the first and both make 3 s and
    2 s; the first cannot make 2.9 s, as nothing can."""
    jobs = [(0.0, 2.0), (1.0, 1.0)]
    assert bound.feasible(jobs, [3.0, 2.0])
    assert not bound.feasible(jobs, [2.9, 2.0])
    assert bound.feasible([(5.0, 1.0)], [6.0])  # an idle server waits for the arrival


def test_the_least_tail_lets_one_request_past_it(bound):
    """A 10 s job at 0 and a 2 s one at 1. With the long one held to 12 s, the short one runs
    at once (tail 2 s); held to 11 s, it can give the short one only 1 s, so the better choice
    is the short one as the exception and a tail of 10 s, the long one's own work."""
    jobs = [(0.0, 10.0), (1.0, 2.0)]
    assert bound.least_tail(jobs, 12.0, 1) == pytest.approx(2.0, abs=1e-3)
    assert bound.least_tail(jobs, 11.0, 1) == pytest.approx(10.0, abs=1e-3)
    assert bound.least_tail(jobs, 12.0, 0) == pytest.approx(11.0, abs=1e-3)  # both within it: short ends at 12
    assert bound.least_tail(jobs, 9.0, 0) == float("inf")  # the long one alone takes 10 s


@pytest.mark.parametrize("n, above", [(96, 0), (179, 1)])
def test_requests_above_the_nearest_rank_p99(bound, n, above):
    """As many as `tieredkv.experiment.metrics.percentile` leaves above its p99, at every size."""
    assert bound.exceptions_of(n) == above
    for size in range(1, 400):
        values = [float(v) for v in range(size)]
        assert bound.exceptions_of(size) == sum(v > percentile(values, 99) for v in values), size
