"""A warm restart as an experiment (`restart_after_s`, `restart_store`): the engine is closed
part-way through the workload and a new one opened on the same store while the clients go on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from tieredkv.experiment.harness import format_comparison, format_summary, run_experiment
from tieredkv.experiment.metrics import RequestRecord, percentiles
from tieredkv.experiment.restart import RestartRecord, restart_figures
from tieredkv.experiment.results import validate
from tieredkv.experiment.spec import Restart, load_experiment

COST = {"d2h_bytes_per_s": 5.0e10, "h2d_bytes_per_s": 5.0e10, "prefill_s_per_token": 3.0e-5,
        "disk_read_bytes_per_s": 2.0e9}
# 64 GPU and 32 CPU blocks of 4 tokens against 8 histories of 24 blocks: most of each first turn
# falls to the CPU tier and from there to the store before the restart
ENGINE = {"model": "tiny-llama",
          "cache": {"block_size": 4, "num_gpu_blocks": 64, "cpu_cache_bytes": "64KiB", "nvme_path": "${results}/nvme",
                    "nvme_bytes": "4MiB", "io_backend": "sync"},
          "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 2, "preemption": "recompute",
                        "cost_model": COST}}
# every first turn is sent at once, before the restart at 0.3 s (which drains them), and every
# second turn at least 1 s later, after it; a 2-token system prompt shares no full block, so
# only the second turns read the store, and only the old engine's blocks
CHAT = {"kind": "multi_turn", "users": 8, "turns": 2, "system_prompt_tokens": 2, "first_message_tokens": 94,
        "message_tokens": 8, "max_tokens": 4, "think_time_s": 1.0}
VARIANTS = [{"name": "store-emptied", "restart_store": "empty"}, {"name": "store-kept", "restart_store": "keep"}]


def write_config(folder: Path, **doc) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "exp", **ENGINE, "workload": CHAT, **doc}))
    return str(path)


def test_restart_keeps_or_empties_the_store_and_loses_no_request(tmp_path):
    config = write_config(tmp_path, restart_after_s=0.3, variants=VARIANTS)
    outcome = run_experiment(config, str(tmp_path / "out"), compare=True, use_tqdm=False)
    emptied, kept = outcome.summaries
    results = {}
    for summary in (emptied, kept):
        folder = tmp_path / "out" / "exp" / summary.name.split("/")[1]
        result = json.loads((folder / "result.json").read_text())
        validate(result)
        results[summary.name] = result
        restart = summary.restart
        assert result["summary"]["restart"]["store"] == restart["store"]
        assert restart["happened"] and restart["began_s"] >= 0.3
        assert restart["closed_s"] <= restart["opening_s"] < restart["ready_s"]
        # nothing lost: every request of both turns finished, with all its tokens
        requests = result["requests"]
        assert len(requests) == 16 and summary.errors == 0
        assert all(r["finished"] and r["error"] is None and len(r["output_token_ids"]) == 4 for r in requests)
        # the first turns ran before the restart began, every second turn on the new engine
        assert {r["tag"].split("/")[1] for r in requests if r["arrival"] < restart["began_s"]} == {"turn0"}
        assert restart["returning_before"] == 0 and restart["returning_after"] == 8
        assert restart["returning_ttft_after_s"]["p50"] > 0
        assert restart["stats_before"]["nvme_spilled_blocks"] > 0  # the old engine wrote the store
        assert "first return after" in format_summary(summary)
    assert emptied.restart["store_removed_bytes"] > 0
    assert {k: emptied.stats[k] for k in ("nvme_restored", "nvme_hits", "nvme_loaded_blocks")} == {
        "nvme_restored": 0, "nvme_hits": 0, "nvme_loaded_blocks": 0}
    assert kept.restart["store_removed_bytes"] is None
    assert kept.stats["nvme_restored"] > 0 and kept.stats["nvme_hits"] > 0 and kept.stats["nvme_loaded_blocks"] > 0
    # KV read back from the kept store gives the tokens recomputing it gives
    tokens = [{r["tag"]: r["output_token_ids"] for r in result["requests"]} for result in results.values()]
    assert tokens[0] == tokens[1]
    comparison = json.loads((tmp_path / "out" / "exp" / "comparison.json").read_text())
    cells = [v["figures"]["restart return p50 ms"] for v in comparison["variants"]]
    assert cells[0]["ratio"] == 1.0 and cells[1]["value"] == pytest.approx(
        kept.restart["returning_ttft_after_s"]["p50"] * 1e3)
    assert "restart return p50 ms" in format_comparison(outcome.summaries)


def test_requests_sent_during_a_restart_wait_for_the_new_engine(tmp_path):
    storm = {"kind": "preemption_storm", "requests": 40, "prompt_tokens": 12, "max_tokens": 3, "rate": 20.0}
    config = write_config(tmp_path, workload=storm, restart_after_s=0.2)
    [summary] = run_experiment(config, str(tmp_path / "out"), use_tqdm=False).summaries
    restart = summary.restart
    assert restart["happened"] and restart["store"] == "keep" and restart["waited_requests"] > 0
    result = json.loads((tmp_path / "out" / "exp" / "result.json").read_text())
    waited = [r for r in result["requests"] if restart["began_s"] <= r["arrival"] < restart["ready_s"]]
    assert len(waited) == restart["waited_requests"]
    assert all(r["token_times"][0] > restart["ready_s"] for r in waited)  # served by the new engine
    for r in waited:  # the wait at the door is a phase of their TTFT, measured: the split sums
        split = r["ttft_split"]
        assert split["restart"] >= restart["ready_s"] - r["arrival"] - 1e-6
        assert sum(split.values()) == pytest.approx(r["ttft"], abs=1e-9) and split["client"] < 0.1 * r["ttft"]
    assert all("restart" not in r["ttft_split"] for r in result["requests"] if r["arrival"] < restart["began_s"])
    assert result["summary"]["ttft_split_s"]["restart"]["p99"] > 0
    assert summary.requests == 40 and summary.errors == 0 and summary.output_tokens == 40 * 3
    assert [t for t in result["timeline"] if restart["closed_s"] < t["t"] < restart["ready_s"]] == []


def test_a_workload_that_ends_first_has_no_restart(tmp_path, caplog):
    config = write_config(tmp_path, workload={**CHAT, "users": 1, "turns": 1, "think_time_s": 0.0},
                          restart_after_s=600)
    with caplog.at_level(logging.WARNING):
        [summary] = run_experiment(config, str(tmp_path / "out"), use_tqdm=False).summaries
    assert summary.restart == {"after_s": 600.0, "store": "keep", "happened": False}
    assert summary.errors == 0 and "ended before restart_after_s" in caplog.text
    assert "none: the workload ended before 600 s" in format_summary(summary)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"restart_after_s": 0}, r"^restart_after_s: expected seconds > 0 into the workload, or null .* got 0$"),
        ({"restart_after_s": "10"}, "restart_after_s: expected seconds > 0"),
        ({"restart_after_s": True}, "restart_after_s: expected seconds > 0"),
        ({"restart_after_s": 5, "restart_store": "wipe"},
         r"restart_store: 'wipe' is not allowed; choose one of 'keep', 'empty'"),
        ({"restart_store": "keep"}, r"^restart_store: set restart_after_s too"),
        ({"restart_after_s": 5, "restart_store": "empty",
          "cache": {**ENGINE["cache"], "nvme_path": None, "nvme_bytes": 0}},
         r"^restart_store: the run has no NVMe store to keep or empty; set cache.nvme_path"),
        ({"variants": [{"name": "a"}, {"name": "b", "restart_after_s": -1}]},
         r"^variants\[1\].restart_after_s: expected seconds > 0"),
        ({"restart_after_s": 5, "variants": [{"name": "a", "restart_store": "gone"}]},
         r"^variants\[0\].restart_store: 'gone' is not allowed"),
    ],
)
def test_restart_keys_are_checked_before_anything_runs(tmp_path, doc, message):
    with pytest.raises(ValueError, match=message):
        load_experiment(write_config(tmp_path, **doc), str(tmp_path / "out"), compare="variants" in doc)


def test_a_variant_sets_or_turns_off_the_restart(tmp_path):
    variants = [{"name": "none", "restart_after_s": None}, {"name": "base"},
                {"name": "emptied", "restart_store": "empty"}, {"name": "later", "restart_after_s": 30}]
    config = write_config(tmp_path, restart_after_s=10, restart_store="keep", variants=variants)
    runs = load_experiment(config, str(tmp_path / "out"), compare=True).runs
    assert [r.restart for r in runs] == [None, Restart(10.0, "keep"), Restart(10.0, "empty"), Restart(30.0, "keep")]
    assert all("restart_after_s" not in r.engine_doc and "restart_store" not in r.engine_doc for r in runs)


def _record(tag: str, arrival: float, first_token: float, returning: bool = True) -> RequestRecord:
    return RequestRecord(tag, arrival, returning, token_times=[first_token], finished=True)


def test_figures_split_at_the_restart_and_count_the_first_return_from_ready():
    start = 100.0
    record = RestartRecord(began=110.0, closed=111.0, opening=112.5, ready=115.0, drained=1, waited=2,
                           store_removed_bytes=None,
                           stats_before={"nvme_spilled_blocks": 7})
    records = [
        _record("user0/turn0", 100.0, 100.5, returning=False),
        _record("user0/turn1", 105.0, 105.2),  # before: 0.2 s
        _record("user1/turn1", 108.0, 108.4),  # before: 0.4 s
        _record("user0/turn2", 112.0, 115.3),  # sent during the restart: 0.3 s from ready
        _record("user1/turn2", 116.0, 116.9),  # after: 0.9 s
        _record("user0/turn3", 120.0, 120.1),  # not the first return of user0 after the restart
        _record("user2/turn0", 117.0, 117.5, returning=False),
    ]
    doc = restart_figures(Restart(10.0, "keep"), record, records, start)
    assert doc["began_s"] == 10.0 and doc["closed_s"] == 11.0 and doc["ready_s"] == 15.0 and doc["downtime_s"] == 5.0
    assert doc["opening_s"] == 12.5
    assert doc["drained_requests"] == 1 and doc["waited_requests"] == 2
    assert doc["stats_before"] == {"nvme_spilled_blocks": 7}
    assert doc["returning_before"] == 2 and doc["returning_ttft_before_s"]["p90"] == pytest.approx(0.4)
    assert doc["returning_after"] == 2 and doc["returning_ttft_after_s"] == pytest.approx(percentiles([0.3, 0.9]))
    assert doc["returning_after_all"] == 3 and doc["returning_ttft_after_all_s"]["p50"] == pytest.approx(0.3)
