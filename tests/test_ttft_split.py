"""Every figure explains itself: each request's TTFT split into queued, loading, prefill and
preempted time (`tieredkv.sequence.TtftSplit`), summing to the TTFT by construction, through
the scheduler with no model (tests/kv_factory.py) and through a run's result.json; and the
engine loop's time by part in `stats()`."""

from __future__ import annotations

import gc
import json
import time

import pytest
import yaml

from tests.kv_factory import make_kv, make_scheduler, make_seq, run_step
from tieredkv import EngineConfig, LLMEngine
from tieredkv.experiment.harness import run_experiment
from tieredkv.experiment.metrics import RequestRecord, ttft_split_figures
from tieredkv.experiment.results import validate
from tieredkv.sequence import Sequence

PAUSE_S = 0.002  # between steps, so that every phase a request goes through lasts


def run_all(sched, sim) -> int:
    """Run to the end, pausing between steps; how many sequences were preempted."""
    preempted = 0
    while sched.has_unfinished():
        time.sleep(PAUSE_S)
        preempted += len(run_step(sched, sim).preempted)
    return preempted


def split_ms(seq: Sequence) -> dict[str, float]:
    """The split in ms, after checking that it sums to the TTFT."""
    seconds = seq.ttft_split.seconds
    assert sum(seconds.values()) == pytest.approx(seq.first_token_time - seq.arrival_time, abs=1e-9)
    return {k: v * 1e3 for k, v in seconds.items()}


def test_a_request_queued_behind_another_then_prefilled():
    sim = make_kv(64)
    sched = make_scheduler(sim, max_num_batched_tokens=16)
    first, second = make_seq("first", range(100, 132), max_tokens=1), make_seq("second", range(200, 208), max_tokens=1)
    sched.add(first)
    sched.add(second)
    assert run_all(sched, sim) == 0
    got = split_ms(second)  # fcfs: waits the two steps of the first one's 32 tokens
    assert got["queued"] >= 2 * PAUSE_S * 1e3 and got["prefill"] > 0 and got["loading"] == got["preempted"] == 0
    assert split_ms(first)["queued"] < got["queued"]


def test_a_request_preempted_before_its_first_token():
    # 8 GPU blocks of 4 tokens: the decoding request's growth preempts the newer one's prefill
    # (recompute) twice before it gets its first token
    sim = make_kv(8)
    sched = make_scheduler(sim, max_num_batched_tokens=8, max_num_seqs=4)
    a, c = make_seq("a", range(100, 108), max_tokens=24), make_seq("c", range(300, 324), max_tokens=2)
    sched.add(a)
    sched.add(c)
    assert run_all(sched, sim) == 2
    got = split_ms(c)
    assert got["preempted"] >= 2 * PAUSE_S * 1e3 and got["prefill"] > 0 and got["queued"] > 0
    assert split_ms(a)["preempted"] == 0


def test_a_request_whose_prefix_is_copied_in_from_the_cpu_tier_was_loading():
    sim = make_kv(8, num_cpu_blocks=32)
    sched = make_scheduler(sim, max_num_batched_tokens=32)
    sched.add(make_seq("doc", range(1000, 1016), max_tokens=1))
    run_all(sched, sim)
    for i in range(3):  # push the document's blocks out of the GPU into the CPU tier
        sched.add(make_seq(f"other{i}", range(2000 + 50 * i, 2024 + 50 * i), max_tokens=1))
        run_all(sched, sim)
    question = make_seq("q", [*range(1000, 1016), 7, 8, 9, 10], max_tokens=1)
    sched.add(question)
    run_all(sched, sim)
    assert question.num_cached_tokens == 16 and sim.kv.stats()["cpu_hit_blocks"] == 4
    got = split_ms(question)
    assert got["loading"] >= PAUSE_S * 1e3 and got["prefill"] > 0 and got["preempted"] == 0


def test_a_run_writes_each_split_and_the_engine_loop_in_a_valid_result(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump({
        "name": "exp", "model": "tiny-llama",
        "cache": {"block_size": 4, "num_gpu_blocks": 64, "cpu_cache_bytes": "128KiB"},
        "scheduler": {"max_num_batched_tokens": 32},
        "workload": {"kind": "multi_turn", "users": 3, "turns": 2, "system_prompt_tokens": 16, "message_tokens": 8,
                     "max_tokens": 3},
    }))
    run_experiment(str(config), str(tmp_path / "out"), use_tqdm=False)
    result = json.loads((tmp_path / "out" / "exp" / "result.json").read_text())
    validate(result)
    for request in result["requests"]:
        split = request["ttft_split"]
        assert set(split) == {"queued", "loading", "prefill", "preempted", "delivery", "client"}
        assert split["prefill"] > 0 and split["delivery"] > 0 and split["client"] >= 0
        assert sum(split.values()) == pytest.approx(request["ttft"], abs=1e-9)
    figures = result["summary"]["ttft_split_s"]
    assert 0 < figures["accounted"] <= 1 and figures["prefill"]["mean"] > 0
    stats = result["summary"]["stats"]
    assert stats["loop_model_s"] > 0 and stats["loop_schedule_s"] > 0 and stats["loop_tiers_s"] > 0
    assert stats["loop_model_s"] > stats["loop_schedule_s"]
    # the longest step, where a stall (a kernel compiled at its first use) shows
    assert 0 < stats["longest_step_s"] <= stats["loop_model_s"]
    # the steps that computed no prefill token (each a gap between two tokens of a request):
    # the loop's own time before their launch is part of each
    assert 0 < stats["decode_steps"] < stats["steps"]
    loop_s = stats["loop_model_s"] + stats["loop_schedule_s"] + stats["loop_tiers_s"]
    assert 0 < stats["decode_step_host_s"] < stats["decode_step_s"] <= loop_s
    assert 0 < stats["decode_step_schedule_s"] < stats["decode_step_host_s"]  # the rest: tier work, tables
    # learned only where steps run behind the loop (a GPU)
    assert stats["launch_s_fixed"] == stats["launch_s_per_token"] == 0.0
    # the collector's pauses, which stop the loop wherever they fall
    assert 0 <= stats["gc_longest_pause_s"] <= stats["gc_pause_s"] and stats["gc_full_collections"] >= 0


def test_the_engine_times_the_collectors_pauses_while_open():
    engine = LLMEngine(EngineConfig.from_kwargs(model="tiny-llama", num_gpu_blocks=16))
    callbacks = len(gc.callbacks)
    before = engine.stats()
    gc.collect()
    after = engine.stats()
    assert after["gc_full_collections"] == before["gc_full_collections"] + 1
    assert after["gc_pause_s"] > before["gc_pause_s"] and after["gc_longest_pause_s"] > 0
    engine.close()
    assert len(gc.callbacks) == callbacks - 1  # a closed engine times nothing


def test_the_phases_add_the_delivery_measured_from_the_engines_first_token():
    record = RequestRecord("r", arrival=10.0, token_times=[10.5, 10.6], engine_first_token=10.46,
                           ttft_split={"queued": 0.1, "loading": 0.0, "prefill": 0.35, "preempted": 0.0})
    phases = record.ttft_phases
    assert phases["delivery"] == pytest.approx(0.04) and phases["client"] == pytest.approx(0.01)
    assert sum(phases.values()) == pytest.approx(record.ttft)
    figures = ttft_split_figures([record])
    assert figures["accounted"] == pytest.approx(0.98) and figures["delivery"]["mean"] == pytest.approx(0.04)
    assert RequestRecord("r", 10.0, token_times=[10.5], ttft_split=record.ttft_split).ttft_phases is None


def test_a_wait_across_a_warm_restart_is_a_phase_of_its_own():
    split = {"queued": 0.1, "loading": 0.0, "prefill": 0.35, "preempted": 0.0}
    waited = RequestRecord("w", arrival=10.0, token_times=[12.5], engine_first_token=12.46, ttft_split=split,
                           restart_wait=2.0)
    phases = waited.ttft_phases
    assert list(phases)[0] == "restart" and phases["client"] == pytest.approx(0.01)
    sent = RequestRecord("s", arrival=10.0, token_times=[10.5], engine_first_token=10.46, ttft_split=split)
    figures = ttft_split_figures([sent, waited])  # the phase counts 0 where it was not
    assert list(figures)[0] == "restart" and figures["restart"]["mean"] == pytest.approx(1.0)
    assert figures["accounted"] == pytest.approx(0.98)
