"""The interval arithmetic behind the benchmarks' GPU-activity figures (benchmarks/gpu_activity.py)
and bench_transfer's two-way table: a span is the first start to the last end, however many
streams ran, and two directions are concurrent only where their copies overlap in time."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MS = 1e-3


@pytest.fixture
def activity(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu_activity")


def copies(activity, kind: str, *spans_ms: tuple[float, float]) -> list:
    name = {"d2h": "Memcpy DtoH (Device -> Pinned)", "h2d": "Memcpy HtoD (Pinned -> Device)"}[kind]
    return [activity.Op(kind, name, a * MS, b * MS) for a, b in spans_ms]


def test_op_kinds_come_from_the_profiler_names(activity):
    assert activity.op_kind("Memcpy DtoH (Device -> Pinned)") == "d2h"
    assert activity.op_kind("Memcpy HtoD (Pinned -> Device)") == "h2d"
    assert activity.op_kind("Memcpy DtoD (Device -> Device)") == "other"
    assert activity.op_kind("Memset (Device)") == "other"
    assert activity.op_kind("_copy_blocks_kernel") == "kernel"


def test_span_busy_and_overlap_of_two_streams(activity):
    d2h = copies(activity, "d2h", (0, 10), (10, 20), (30, 35))
    h2d = copies(activity, "h2d", (5, 25), (24, 26))
    assert activity.span_s(d2h + h2d) == pytest.approx(35 * MS)  # not the sum of each stream's span (60 ms)
    assert activity.busy_s(d2h) == pytest.approx(25 * MS) and activity.busy_s(h2d) == pytest.approx(21 * MS)
    assert activity.busy_s(d2h + h2d) == pytest.approx(31 * MS)
    assert activity.overlap_s(d2h, h2d) == pytest.approx(15 * MS)
    assert activity.overlap_s(h2d, d2h) == pytest.approx(15 * MS)
    assert activity.span_s([]) == 0.0 and activity.overlap_s(d2h, []) == 0.0


def test_two_way_concurrency_tells_side_by_side_from_taking_turns(activity):
    ids = [activity.Op("h2d", "Memcpy HtoD (Pageable -> Device)", 0.0, 5e-6)]  # a job's block ids: not data
    side_by_side = activity.TwoWay.of(ids + copies(activity, "d2h", (0, 20)) + copies(activity, "h2d", (1, 21)))
    assert side_by_side.concurrency == pytest.approx(19 / 20) and side_by_side.later_start_s == pytest.approx(1 * MS)
    # the model of two jobs whose streams share hardware queues: half of the swap-out alone, then
    # the swap-in beside the rest of it and alone after it (58.5 ms for 2 x 2 GiB at 55 GB/s)
    turns = activity.TwoWay.of(copies(activity, "d2h", (0, 39)) + copies(activity, "h2d", (19.5, 58.5)))
    assert turns.d2h_s == pytest.approx(39 * MS) and turns.both_s == pytest.approx(19.5 * MS)
    assert turns.concurrency == pytest.approx(0.5) and turns.later_start_s == pytest.approx(19.5 * MS)
    serial = activity.TwoWay.of(copies(activity, "d2h", (0, 20)) + copies(activity, "h2d", (20, 40)))
    assert serial.concurrency == 0.0
    with pytest.raises(ValueError, match="needs copies both ways; the trace has 1 D2H and 0 H2D"):
        activity.TwoWay.of(ids + copies(activity, "d2h", (0, 20)))


def test_two_way_table_judges_each_run_by_every_method(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_transfer")

    def run(sleep: float, submit: float, activity: float, concurrency: float) -> list[dict]:
        figures = [{"case": "two-way", "method": m, "value": ratio * 100.0, "peak": 100.0}
                   for m, ratio in (("sleep", sleep), ("submit", submit), ("activity", activity))]
        return [{"case": "swap-in 2048 tokens (128 blocks)", "method": "submit", "value": 1.0, "peak": 100.0},
                *figures, {"case": "two-way", "method": "sleep", "evidence": {"concurrency": concurrency}}]

    lines = bench.two_way_table([run(0.70, 0.92, 0.95, 0.5), run(0.99, 0.89, 0.97, 1.0), run(0.95, 0.93, 0.91, 1.0)])
    assert lines[1] == ("  run 1: GPU time, queued behind a sleep 70.0% (copies side by side 50%); from the submit "
                        "call 92.0%; GPU activity (profiler), from the submit call 95.0%  [FAIL]")
    assert lines[2].endswith("[FAIL]") and lines[3].endswith("[PASS]")
    assert lines[-1] == "  >= 90% by every method in 1 of 3 runs"
