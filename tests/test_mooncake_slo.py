"""The Mooncake real-trace experiments: the per-request SLO (TTFT and slow ITL, the mean of a
request's slowest 10% of token gaps), goodput under it, the replay speed, the prefix-hit bound,
and the shipped configs and slices."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tieredkv.experiment.harness import run_experiment
from tieredkv.experiment.metrics import RequestRecord, Summary, slowest_mean
from tieredkv.experiment.results import validate
from tieredkv.experiment.slo import Slo, meets
from tieredkv.experiment.spec import load_experiment
from tieredkv.experiment.sweep import format_sweep
from tieredkv.experiment.traces import TraceLine, prefix_hit_bound
from tieredkv.experiment.workloads import make_workload

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MOONCAKE_SLO = {"ttft_ms": 30000, "slow_itl_ms": 100, "attainment": 0.9}


def record(tag: str, ttft: float, gaps: list[float], error: str | None = None) -> RequestRecord:
    """A finished request sent at 0 whose first token came at `ttft` and the rest `gaps` apart."""
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(tag, 0.0, token_times=[] if error else times, error=error, finished=True)


def summary(records: list[RequestRecord], elapsed_s: float) -> Summary:
    errors = sum(r.error is not None for r in records)
    return Summary("s", len(records), errors, 0, 0, elapsed_s, {}, {}, {}, {})


def test_slow_itl_is_the_mean_of_the_slowest_tenth_of_the_gaps():
    # 10 gaps: the slowest one; 20 gaps: the slowest two; 25 gaps: three (ceil 2.5); 30: three, not four
    assert record("a", 1.0, [0.05] * 9 + [0.25]).slow_itl == pytest.approx(0.25)
    assert record("b", 1.0, [0.02] * 18 + [0.15, 0.03]).slow_itl == pytest.approx(0.09)
    assert slowest_mean([1.0] * 22 + [5.0, 6.0, 7.0], 0.1) == pytest.approx(6.0)
    assert slowest_mean([1.0] * 27 + [4.0, 5.0, 9.0], 0.1) == pytest.approx(6.0)
    assert slowest_mean([0.3, 0.1], 0.1) == pytest.approx(0.3)  # at least one gap
    assert record("one token", 1.0, []).slow_itl is None
    assert slowest_mean([], 0.1) is None


def test_per_request_slo_attainment_and_goodput_by_hand():
    records = [
        record("a", 1.0, [0.05] * 9 + [0.25]),  # slow ITL 250 ms: misses
        record("b", 1.0, [0.02] * 18 + [0.15, 0.03]),  # one 150 ms stall, slowest two average 90 ms: meets
        record("c", 31.0, []),  # TTFT 31 s: misses
        record("d", 2.0, []),  # one token, no gap to miss: meets
        record("e", 0.0, [], error="prompt too long"),  # failed: misses
    ]
    slo = Slo.from_dict(MOONCAKE_SLO)
    assert [meets(r, slo.per_request) for r in records] == [False, True, False, True, False]
    measured = slo.measure(records)
    assert measured == {"ttft_ms": pytest.approx(3 / 5), "slow_itl_ms": pytest.approx(3 / 5),
                        "attainment": pytest.approx(2 / 5)}
    assert slo.goodput_rps(records, elapsed_s=40.0) == pytest.approx(2 / 40)
    assert not slo.holds(measured, summary(records, 40.0))
    # without the failed request: 2 of 4 meet it, which holds at attainment 0.5 and not at 0.9
    ok = records[:4]
    assert Slo.from_dict({**MOONCAKE_SLO, "attainment": 0.5}).holds(slo.measure(ok), summary(ok, 40.0))
    assert not slo.holds(slo.measure(ok), summary(ok, 40.0))


def test_attainment_defaults_to_nine_tenths_and_mixes_with_targets_over_all_requests():
    slo = Slo.from_dict({"ttft_ms": 30000, "ttft_p90_ms": 5000, "slow_itl_p90_ms": 80})
    assert slo.targets == {"ttft_ms": 30000.0, "ttft_p90_ms": 5000.0, "slow_itl_p90_ms": 80.0, "attainment": 0.9}
    records = [record(str(i), 1.0 + i, [0.01] * 9 + [0.05 + 0.01 * i]) for i in range(10)]
    measured = slo.measure(records)
    assert measured["ttft_p90_ms"] == pytest.approx(10_000.0)  # TTFTs 1..10 s: over its 5 s target
    assert measured["slow_itl_p90_ms"] == pytest.approx(140.0)  # nearest rank: the 10th of 10
    assert measured["attainment"] == 1.0
    assert not slo.holds(measured, summary(records, 10.0))
    assert Slo.from_dict({"ttft_p90_ms": 2000}).goodput_rps(records, 10.0) is None  # no per-request bound


@pytest.mark.parametrize("section, message", [
    ({"ttft_p90_ms": 2000, "attainment": 0.9}, "slo.attainment: counts requests that meet per-request targets"),
    ({"ttft_ms": 30000, "attainment": 1.5}, r"slo.attainment: expected the share .* in \(0, 1\], got 1.5"),
    ({"slow_gap_mean_ms": 100}, "slo.slow_gap_mean_ms: not a target; .* or <latency>_ms for a bound on each "
                                "request"),
    ({"itl_ms": 100}, "slo.itl_ms: not a target"),
    ({"slow_itl_ms": 0}, r"slo.slow_itl_ms: expected milliseconds > 0, got 0"),
])
def test_slo_errors_name_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        Slo.from_dict(section)


def line(n: int, length: int, ids: list[int]) -> TraceLine:
    return TraceLine(n, float(n), 1, input_length=length, hash_ids=tuple(ids))


def test_prefix_hit_bound_by_hand():
    lines = [
        line(1, 1000, [1, 2]),  # nothing before it
        line(2, 1100, [1, 2, 3]),  # line 1 sent 1000 tokens of ids 1, 2 (the second block partial): 992 in blocks of 16
        line(3, 600, [1, 4]),  # shares id 1 (512 tokens) with lines 1 and 2
        line(4, 10, [5]),
        line(5, 1000, [1, 2]),  # all of line 1 again: every token but the last, in full blocks: 992
    ]
    assert prefix_hit_bound(lines, 512, 16) == pytest.approx((992 + 512 + 992) / (1000 + 1100 + 600 + 10 + 1000))
    assert prefix_hit_bound(lines, 512, 1) == pytest.approx((1000 + 512 + 999) / 3710)


def test_speed_divides_the_trace_gaps(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 20, "output_length": 2, "hash_ids": [i]}) + "\n"
                            for i, t in enumerate([1000, 3000, 7000])))
    fast = make_workload({"kind": "replay", "path": str(path), "speed": 4})
    assert [r.time_s for r in fast.requests] == pytest.approx([0.0, 0.5, 1.5])
    assert [r.time_s for r in make_workload({"kind": "replay", "path": str(path), "time_scale": 0.25}).requests] == \
        pytest.approx([0.0, 0.5, 1.5])
    with pytest.raises(ValueError, match="workload.speed: set either speed or rate / time_scale, not both"):
        make_workload({"kind": "replay", "path": str(path), "speed": 2, "rate": 1.0})
    with pytest.raises(ValueError, match=r"workload.speed: expected a factor > 0 .*, got 0"):
        make_workload({"kind": "replay", "path": str(path), "speed": 0})


@pytest.mark.parametrize("name, counts", [
    # requests, returning, conversations, prompt tokens, prefix-hit bound, lines in the file, speeds
    ("conversation", (127, 35, 92, 1_643_470, 0.274, 127, [2, 3, 6])),
    ("synthetic", (99, 34, 65, 1_353_751, 0.341, 108, [8, 16, 24])),
])
def test_shipped_real_trace_configs_match_their_headers(name, counts):
    requests, returning, conversations, prompt_tokens, bound, lines, speeds = counts
    config = CONFIGS / f"mooncake_{name}_8b.yaml"
    experiment = load_experiment(str(config))
    variants = ["recompute-only", "gpu+cpu16", "gpu+cpu64", "gpu+cpu16+nvme"]
    assert [r.name for r in experiment.runs] == [f"mooncake_{name}_8b/{v}/speed={s}" for v in variants for s in speeds]
    assert experiment.slo.targets == {"ttft_ms": 30000, "slow_itl_ms": 100, "attainment": 0.9}
    gpu_kv = {r.variant: r.engine_doc["cache"] for r in experiment.runs}
    gpu_tokens = 131_072  # 16 GiB of llama-3-8b KV at 128 KiB a token
    assert {v: (c["num_gpu_blocks"] * c["block_size"], c["cpu_cache_bytes"], c.get("nvme_bytes"))
            for v, c in gpu_kv.items()} == {
        "recompute-only": (gpu_tokens, 0, None), "gpu+cpu16": (gpu_tokens, "16GiB", None),
        "gpu+cpu64": (gpu_tokens, "64GiB", None), "gpu+cpu16+nvme": (gpu_tokens, "16GiB", "40GiB")}
    trace = experiment.runs[0].workload.describe()
    assert (trace["requests"], trace["returning"], trace["conversations"], trace["prompt_tokens"], trace["lines"]) \
        == (requests, returning, conversations, prompt_tokens, lines)
    assert trace["prefix_hit_bound"] == pytest.approx(bound, abs=5e-4)
    assert trace["span_s"] == pytest.approx(599.3 / speeds[0] if name == "synthetic" else 591.0 / speeds[0], abs=0.01)
    slice_file = CONFIGS / f"mooncake_{name}_window.jsonl"
    assert slice_file.stat().st_size < 300 * 1024
    header = config.read_text().split("\nname:")[0]
    assert f"{requests} requests" in header and f"{bound:.1%}" in header


def test_a_shrunk_real_trace_sweep_runs_on_cpu_and_reports_goodput(tmp_path):
    """The shipped conversation config on a tiny model: four short prompts of its slice, two
    variants, two speeds; each point's goodput is what the requests' own times say."""
    doc = yaml.safe_load((CONFIGS / "mooncake_conversation_8b.yaml").read_text())
    doc.update(model="tiny-llama", device="cpu", dtype="float32",
               cache={"block_size": 16, "num_gpu_blocks": 160, "cpu_cache_bytes": "2MiB"},
               scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 512, "preemption": "auto"},
               sweep={"speed": [200, 400]},
               variants=[{"name": "recompute-only", "cache": {"cpu_cache_bytes": 0}}, {"name": "gpu+cpu"}])
    doc["workload"].update(path=str(CONFIGS / doc["workload"]["path"]), max_input_tokens=1100, max_requests=4,
                           max_output_tokens=4)
    config = tmp_path / "shrunk.yaml"
    config.write_text(yaml.safe_dump(doc))
    outcome = run_experiment(str(config), str(tmp_path / "out"), use_tqdm=False)
    sweep = outcome.sweep
    assert [v["name"] for v in sweep["variants"]] == ["recompute-only", "gpu+cpu"]
    for variant in sweep["variants"]:
        assert [p["value"] for p in variant["points"]] == [200, 400]
        for point in variant["points"]:
            result = json.loads(Path(point["result"]).read_text())
            validate(result)
            assert result["workload"]["speed"] == point["value"] and len(result["requests"]) == 4
            met = [r["finished"] and r["error"] is None and r["ttft"] <= 30 and _slow_itl(r["token_times"]) <= 0.1
                   for r in result["requests"]]
            assert point["slo_attainment"] == pytest.approx(sum(met) / 4)
            assert point["goodput_rps"] == pytest.approx(sum(met) / result["metrics"]["duration"])
            assert point["slo_met"] == (sum(met) / 4 >= 0.9)
    table = format_sweep(sweep)
    assert "within %" in table and "good req/s" in table and "(met by 90% of requests)" in table


def _slow_itl(times: list[float]) -> float:
    gaps = sorted((b - a for a, b in zip(times, times[1:], strict=False)), reverse=True)
    k = max(1, math.ceil(len(gaps) / 10 - 1e-9))
    return sum(gaps[:k]) / k
