"""`tieredkv run` as a user meets it: sweeps and goodput, self-describing results, compare
plots, Ctrl-C, start-up errors as one line, paths from the config's folder, honest metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tieredkv.cli import main
from tieredkv.experiment.harness import run_experiment
from tieredkv.experiment.metrics import RequestRecord, format_summary, summarize
from tieredkv.experiment.results import validate
from tieredkv.experiment.sweep import goodput

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"model": "tiny-llama", "cache": {"block_size": 4, "num_gpu_blocks": 64, "cpu_cache_bytes": "128KiB"},
          "scheduler": {"max_num_batched_tokens": 64}}
CHAT = {"kind": "multi_turn", "users": 2, "turns": 2, "system_prompt_tokens": 16, "message_tokens": 4, "max_tokens": 3}
VARIANTS = [{"name": "recompute-only", "cache": {"cpu_cache_bytes": 0}, "scheduler": {"preemption": "recompute"}},
            {"name": "gpu+cpu", "scheduler": {"preemption": "swap"}}]
COST = {"d2h_bytes_per_s": 5.0e10, "h2d_bytes_per_s": 5.0e10, "prefill_s_per_token": 3.0e-5,
        "disk_read_bytes_per_s": 2.0e9}


def write_config(folder: Path, workload: dict = CHAT, **extra) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "exp", **ENGINE, "workload": workload, **extra}))
    return str(path)


def test_two_rate_two_variant_sweep_gives_goodput_and_its_plot(tmp_path, capsys):
    config = write_config(tmp_path, variants=VARIANTS, slo={"ttft_p90_ms": 60000, "tpot_p90_ms": 60000})
    assert main(["run", config, "--sweep", "rate=50,100", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "out" / "exp"
    sweep = json.loads((folder / "sweep.json").read_text())
    assert sweep["key"] == "rate" and sweep["points"] == [50, 100]
    assert sweep["slo"] == {"ttft_p90_ms": 60000.0, "tpot_p90_ms": 60000.0}
    assert [v["name"] for v in sweep["variants"]] == ["recompute-only", "gpu+cpu"]
    for variant in sweep["variants"]:
        assert [p["value"] for p in variant["points"]] == [50, 100]
        assert all(p["slo_met"] and p["p90_ttft_ms"] > 0 and p["request_throughput"] > 0 for p in variant["points"])
        assert variant["goodput"] == 100  # generous targets: met at both points
        for point in variant["points"]:
            result = json.loads(Path(point["result"]).read_text())
            validate(result)
            assert result["load_point"] == {"rate": point["value"]} and result["slo"]["met"] is True
            assert result["workload"]["rate"] == point["value"]
    assert (folder / "sweep.png").stat().st_size > 0
    assert (folder / "gpu+cpu" / "rate=100" / "result.json").exists()
    assert re.search(r"^  recompute-only +100$", out, re.M) and re.search(r"^  gpu\+cpu +100$", out, re.M)


def test_a_load_point_that_fails_holds_no_slo(tmp_path, monkeypatch, capsys):
    """gpu+cpu's lower point fails: it is in sweep.json without figures, its goodput is none
    (the point above it is not capacity), and the other variant's sweep is whole."""
    from tieredkv.experiment import harness

    serve = harness._serve

    async def failing_at_50(slot, config, run, *args):
        if run.name.endswith("gpu+cpu/rate=50"):
            raise RuntimeError("the disk went away")
        return await serve(slot, config, run, *args)

    monkeypatch.setattr(harness, "_serve", failing_at_50)
    config = write_config(tmp_path, variants=VARIANTS, slo={"ttft_p90_ms": 60000})
    assert main(["run", config, "--sweep", "rate=50,100", "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert "tieredkv: failed: exp/gpu+cpu/rate=50: RuntimeError: the disk went away" in err
    sweep = json.loads((tmp_path / "out" / "exp" / "sweep.json").read_text())
    whole, broken = sweep["variants"]
    assert whole["goodput"] == 100 and not any(p["failed"] for p in whole["points"])
    points = [(p["value"], p["failed"], p["slo_met"]) for p in broken["points"]]
    assert points == [(50, True, False), (100, False, True)]
    assert broken["goodput"] is None and broken["points"][0]["p90_ttft_ms"] is None
    assert "(failed)" in out and (tmp_path / "out" / "exp" / "sweep.png").stat().st_size > 0


def test_goodput_is_the_highest_load_held_from_the_bottom_up():
    def points(*met):
        return [{"value": v, "slo_met": m} for v, m in zip((0.5, 1, 2, 4), met, strict=False)]

    assert goodput(points(True, True, False, False)) == 1
    assert goodput(points(True, False, True, True)) == 0.5  # a lucky point above a miss is not capacity
    assert goodput(points(False, True, True, True)) is None
    assert goodput(points(True, True, True, True)) == 4


def test_a_missed_slo_is_a_miss(tmp_path):
    config = write_config(tmp_path, slo={"ttft_p90_ms": 1e-6})
    [summary] = run_experiment(config, str(tmp_path / "out"), use_tqdm=False, sweep="rate=100").summaries
    sweep = json.loads((tmp_path / "out" / "exp" / "sweep.json").read_text())
    [variant] = sweep["variants"]
    assert variant["name"] == "exp" and variant["goodput"] is None and variant["points"][0]["slo_met"] is False
    assert variant["points"][0]["slo_measured"]["ttft_p90_ms"] > 1e-6


@pytest.mark.parametrize(
    "change, message",
    [
        ({"slo": {"ttft_p90": 100}}, "slo.ttft_p90: not a target; write <latency>_<statistic>_ms"),
        ({"slo": {"ttft_p90_ms": -1}}, r"slo.ttft_p90_ms: expected milliseconds > 0"),
        ({"slo": {"ttft_p150_ms": 100}}, r"slo.ttft_p150_ms: a percentile is at most p100, got p150"),
        ({"sweep": {"rate": [1, 1]}}, "sweep.rate: load point listed twice"),
        ({"sweep": {"rate": 2, "users": 3}}, "sweep: expected one workload key"),
        ({"sweep": {"rte": [1, 2]}}, "unknown key 'sweep rte': did you mean 'sweep rate'?"),
    ],
)
def test_sweep_and_slo_errors_name_the_key(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        run_experiment(write_config(tmp_path, **change), str(tmp_path / "out"), use_tqdm=False)


def test_a_load_point_past_the_bound_fails_when_the_file_loads(tmp_path):
    """`--sweep users=1e20` used to draw every prompt before the first was sent, until the
    process was killed for memory."""
    from tieredkv.experiment.spec import load_experiment

    with pytest.raises(ValueError, match=r"workload.users: expected an integer in \[1, 1000000\], got 10+$"):
        load_experiment(write_config(tmp_path), str(tmp_path / "out"), sweep="users=2,1e20")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_named_inside_a_git_checkout_and_none_outside(tmp_path):
    from tieredkv.experiment.results import _git_commit

    assert _git_commit(tmp_path) is None  # a source tarball
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "tracked").write_text("1")
    subprocess.run([*git, "add", "tracked"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert _git_commit(tmp_path) == head
    (tmp_path / "untracked").write_text("x")
    assert _git_commit(tmp_path) == head  # untracked files do not make it dirty
    (tmp_path / "tracked").write_text("2")
    assert _git_commit(tmp_path) == f"{head}+dirty"


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "in-process"])
def test_result_json_describes_what_produced_it(tmp_path, engine_process):
    cache = {**ENGINE["cache"], "nvme_path": "${results}/nvme", "nvme_bytes": "4MiB", "io_backend": "sync"}
    config = write_config(tmp_path, **{"cache": cache, "scheduler": {**ENGINE["scheduler"], "cost_model": COST}})
    run_experiment(config, str(tmp_path / "out"), use_tqdm=False, keep_prompt_ids=True, engine_process=engine_process)
    folder = tmp_path / "out" / "exp"
    result = json.loads((folder / "result.json").read_text())
    validate(result)
    engine = result["engine"]
    block_bytes = engine["block_bytes"]
    assert block_bytes == 2 * 2 * 4 * 2 * 16 * 4  # layers, K and V, tokens, kv heads, head dim, float32
    assert engine["tiers"]["gpu"] == {"blocks": 64, "tokens": 256, "bytes": 64 * block_bytes}
    assert engine["tiers"]["cpu"]["blocks"] == 128 * 1024 // block_bytes
    assert engine["tiers"]["nvme"]["blocks"] > 0 and engine["tiers"]["nvme"]["path"] == str(folder / "nvme")
    assert engine["io_backend"] == "sync"
    assert engine["cost_model"] == {**COST, "prefill_s_per_token_sq": 0.0, "read_latency_s": 0.0, "source": "pinned"}
    assert engine["config"]["cache"]["nvme_path"] == str(folder / "nvme") and engine["device"].startswith("cpu")
    env = result["environment"]
    assert env["versions"]["tieredkv"] and env["versions"]["torch"] and env["versions"]["transformers"]
    if (ROOT / ".git").exists():  # a checkout: its commit
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert env["git_commit"].removesuffix("+dirty") == head.stdout.strip()
    else:  # a source tarball: no commit to name
        assert env["git_commit"] is None
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", env["date"])
    assert result["workload"] == {**CHAT, "first_message_tokens": None, "think_time_s": 0.0, "rate": None,
                                  "seed": 0, "num_requests": 4}
    for r in result["requests"]:
        assert len(r["output_token_ids"]) == 3 and len(r["prompt_token_ids"]) == r["prompt_tokens"]
    assert result["metrics"]["completed"] == 4 and result["metrics"]["p90_ttft_ms"] > 0
    replayed = result["cpu_tier_replay"]  # its CPU tier's block trace, replayed under each policy
    assert replayed["capacity_blocks"] == engine["tiers"]["cpu"]["blocks"] and replayed["requested_blocks"] > 0
    assert set(replayed["hit_rate"]) == {"lru", "tinylfu", "adaptive", "arc", "wtinylfu", "belady"}
    assert all(0 <= rate <= 1 for rate in replayed["hit_rate"].values())
    assert not (folder / "nvme").exists()  # a store in the results folder is scratch
    del result["engine"]
    with pytest.raises(Exception, match="'engine' is a required property"):
        validate(result)


def test_compare_writes_comparison_json_and_overlaid_plots(tmp_path):
    config = write_config(tmp_path, variants=VARIANTS)
    folder = tmp_path / "out" / "exp"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text("{}")  # an earlier run's files go
    (folder / "old.png").write_text("")
    outcome = run_experiment(config, str(tmp_path / "out"), compare=True, use_tqdm=False)
    comparison = json.loads((folder / "comparison.json").read_text())
    assert comparison == outcome.comparison and comparison["baseline"] == "exp/recompute-only"
    assert [v["name"] for v in comparison["variants"]] == ["exp/recompute-only", "exp/gpu+cpu"]
    first = comparison["variants"][0]["figures"]
    assert first["output tok/s"]["ratio"] == 1.0 and first["return TTFT p50 ms"]["value"] > 0
    for name in ("compare_ttft_cdf.png", "compare_throughput.png", "compare_blocks.png"):
        assert (folder / name).stat().st_size > 0
    assert sorted(p.name for p in folder.iterdir()) == [
        ".tieredkv-results", "compare_blocks.png", "compare_throughput.png", "compare_ttft_cdf.png",
        "comparison.json", "gpu+cpu", "recompute-only"]


def test_a_variant_that_fails_costs_only_itself(tmp_path, monkeypatch, capsys):
    """The first variant's engine fails as it is built: the run logs it, the next variant runs
    and is compared, and the command ends with status 1 and one line naming the failure."""
    from tieredkv.experiment import harness

    class FailingWithACpuTier(harness.AsyncLLM):
        def __init__(self, config, engine_process):
            if config.cache.cpu_cache_bytes:
                raise RuntimeError("capture failed")
            super().__init__(config=config, engine_process=engine_process)

    monkeypatch.setattr(harness, "AsyncLLM", FailingWithACpuTier)
    config = write_config(tmp_path, variants=VARIANTS)
    outcome = run_experiment(config, str(tmp_path / "out"), compare=True, use_tqdm=False,
                             only=["gpu+cpu", "recompute-only"])
    assert outcome.failed == ["exp/gpu+cpu: RuntimeError: capture failed"]
    assert [s.name for s in outcome.summaries] == ["exp/recompute-only"]
    assert (tmp_path / "out" / "exp" / "recompute-only" / "result.json").exists()
    comparison = json.loads((tmp_path / "out" / "exp" / "comparison.json").read_text())
    assert comparison["failed"] == outcome.failed and len(comparison["variants"]) == 1
    assert main(["run", config, "--compare", "--variants", "gpu+cpu,recompute-only", "--out",
                 str(tmp_path / "again"), "--no-progress"]) == 1
    assert "tieredkv: failed: exp/gpu+cpu: RuntimeError: capture failed" in capsys.readouterr().err
    alone = write_config(tmp_path / "alone", variants=VARIANTS[1:])  # a run of its own fails as before
    with pytest.raises(RuntimeError, match="capture failed"):
        run_experiment(alone, str(tmp_path / "out2"), use_tqdm=False)


def test_sigint_mid_run_leaves_a_partial_result(tmp_path):
    storm = {"kind": "preemption_storm", "requests": 400, "prompt_tokens": 16, "max_tokens": 32, "rate": 100.0}
    config = write_config(tmp_path, storm)
    proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", "run", config, "--out", str(tmp_path / "out"),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stderr:  # the start-up summary comes when the engine is built and the workload starts
        if "tieredkv.experiment.harness: exp:" in line:
            break
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted: partial results in" in stderr and "Traceback" not in stderr
    result = json.loads((tmp_path / "out" / "exp" / "result.json").read_text())
    validate(result)
    assert result["partial"] is True and result["summary"]["partial"] is True
    assert 0 < len(result["requests"]) < 400
    assert any(r["token_times"] for r in result["requests"]) and result["timeline"]
    assert not all(r["finished"] for r in result["requests"])  # those in flight were cut short
    assert "[interrupted: partial]" in stdout


def test_prefix_hit_rate_counts_only_the_clients_prompts(tmp_path):
    """Distinct random prompts share nothing; recomputed sequences find their own blocks again,
    which is not a hit."""
    storm = {"kind": "preemption_storm", "requests": 8, "prompt_tokens": 40, "max_tokens": 40}
    config = write_config(tmp_path, storm, cache={"block_size": 4, "num_gpu_blocks": 48},
                          scheduler={"preemption": "recompute", "max_num_batched_tokens": 64})
    [summary] = run_experiment(config, str(tmp_path / "out"), use_tqdm=False).summaries
    assert summary.stats["preemptions"]["recompute"] > 0
    assert summary.stats["prefix_hit_tokens"] == summary.cached_tokens == 0
    assert summary.prefix_hit_rate == 0.0


def test_an_empty_row_prints_n_a():
    records = [RequestRecord("a", 0.0, False, [0.1]), RequestRecord("b", 0.0, False, error="rejected")]
    summary = summarize("run", records, 1.0, {})
    text = format_summary(summary)
    assert re.search(r"^  returning requests +n/a$", text, re.M)
    assert re.search(r"^TPOT p50 / p90 / p99 +n/a$", text, re.M)  # one token: no time per output token
    assert re.search(r"^TTFT p50 / p90 / p99 +100.0 / 100.0 / 100.0 ms$", text, re.M)
    assert re.search(r"^prefix hit rate +n/a$", format_summary(summarize("run", [], 1.0, {})), re.M)


# ---------------------------------------------------------------------------- start-up errors


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tieredkv: error: "), err
    return err[0]


def test_unwritable_results_folder_is_one_line_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "out"
    blocker.write_text("a file where the results folder would go")
    assert main(["run", write_config(tmp_path), "--out", str(blocker), "--no-progress"]) == 2
    assert f"--out: cannot write results in {blocker}/exp" in one_error_line(capsys)


def test_results_folder_with_foreign_files_is_left_alone(tmp_path, capsys):
    (tmp_path / "out" / "exp").mkdir(parents=True)
    (tmp_path / "out" / "exp" / "thesis.tex").write_text("mine")
    assert main(["run", write_config(tmp_path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "holds files that tieredkv run did not write" in one_error_line(capsys)
    assert (tmp_path / "out" / "exp" / "thesis.tex").read_text() == "mine"


def test_locked_store_is_one_line_before_any_variant_runs(tmp_path, capsys):
    """The second variant's store is held by another engine: nothing runs, not even the first."""
    from tieredkv import LLM

    store = tmp_path / "store"
    variants = [VARIANTS[0], {"name": "nvme", "cache": {"nvme_path": str(store), "nvme_bytes": "4MiB"},
                              "scheduler": {"cost_model": COST}}]
    config = write_config(tmp_path, variants=variants)
    holder = LLM(model="tiny-llama", block_size=4, num_gpu_blocks=64, cpu_cache_bytes="128KiB",
                 nvme_path=str(store), nvme_bytes="4MiB", cost_model=COST)
    try:
        code = main(["run", config, "--compare", "--out", str(tmp_path / "out"), "--no-progress"])
    finally:
        holder.close()
    assert code == 2
    assert "cache.nvme_path: the store" in one_error_line(capsys) and "is in use by another process" in \
        capsys.readouterr().err + "is in use by another process"
    assert not (tmp_path / "out" / "exp" / "recompute-only").exists()


def test_config_errors_are_one_line(tmp_path, capsys):
    config = write_config(tmp_path, variants=[{"name": "x", "cache": {"blok_size": 4}}])
    assert main(["run", config, "--compare", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "did you mean 'cache.block_size'" in one_error_line(capsys)
    assert main(["run", config, "--sweep", "rate", "--no-progress"]) == 2
    assert "--sweep: expected KEY=V1,V2,..." in one_error_line(capsys)


@pytest.mark.parametrize("variant, message", [
    ({"name": "b", "cahce": {"block_size": 4}}, "variants[1]: unknown key 'cahce': did you mean 'cache'?"),
    ({"name": "b", "restart_afterwards": 1}, "variants[1]: unknown key 'restart_afterwards': did you mean "
                                             "'restart_after_s'?"),
    ({"name": "b", "cache": {"blok_size": 4}}, "variants[1]: unknown key 'cache.blok_size'"),
    ({"name": "b", "model": "no-such-model"}, "variants[1]: model: 'no-such-model' is neither a preset"),
])
def test_a_variant_error_names_the_variant_before_anything_runs(tmp_path, variant, message):
    """The second variant's model used to be found missing only after the first variant ran."""
    from tieredkv.experiment.spec import load_experiment

    config = write_config(tmp_path, variants=[VARIANTS[0], variant])
    with pytest.raises(ValueError) as err:
        load_experiment(config, str(tmp_path / "out"), compare=True)
    assert str(err.value).startswith(message)


# ---------------------------------------------------------------------------- paths, logging, defaults


def test_relative_paths_are_taken_from_the_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "experiments"
    folder.mkdir()
    (folder / "trace.jsonl").write_text(json.dumps({"time": 0.0, "prompt": [5, 6, 7, 8, 9]}) + "\n")
    cache = {**ENGINE["cache"], "nvme_path": "store", "nvme_bytes": "4MiB"}
    config = write_config(folder, {"kind": "replay", "path": "trace.jsonl", "max_tokens": 2},
                          cache=cache, scheduler={"cost_model": COST})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    outcome = run_experiment(os.path.relpath(config), "out", use_tqdm=False)
    assert outcome.summaries[0].errors == 0 and outcome.summaries[0].requests == 1
    result = json.loads((elsewhere / "out" / "exp" / "result.json").read_text())
    assert result["workload"]["path"] == str(folder / "trace.jsonl")
    assert result["engine"]["tiers"]["nvme"]["path"] == str(folder / "store")
    assert (folder / "store").exists() and not (elsewhere / "store").exists()


def test_logging_progress_and_start_up_summary(tmp_path, capsys):
    storm = {"kind": "preemption_storm", "requests": 12, "prompt_tokens": 16, "max_tokens": 24, "rate": 12.0}
    assert main(["run", write_config(tmp_path, storm), "--out", str(tmp_path / "out"), "-v"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"INFO tieredkv.experiment.harness: exp: cpu .*GPU 64 blocks \(256 tokens, 0.1 MiB\), CPU 64 "
                     r"blocks \(256 tokens, 0.1 MiB\); preemption auto; cost model calibrated: D2H", err)
    assert re.search(r"\d+ tok/s, GPU \d+/64 \(\d+ cached\), CPU \d+/64 \(\d+ cached\)", err)  # the progress bar
    assert main(["run", write_config(tmp_path, storm), "--out", str(tmp_path / "out"), "--no-progress",
                 "--log-level", "warning"]) == 0
    assert "INFO" not in capsys.readouterr().err


def test_default_config_is_found_anywhere_and_hits_every_tier(tmp_path, monkeypatch, capsys):
    """`tieredkv run` in an empty folder runs the shipped demo; its returning turns find their
    histories on the GPU, in the CPU tier and on NVMe (in the results folder, emptied per run)."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^requests +24 \(0 errors\)", out, re.M)
    result = json.loads((tmp_path / "results" / "demo" / "result.json").read_text())
    stats = result["summary"]["stats"]
    assert stats["gpu_hit_blocks"] > 0 and stats["cpu_hit_blocks"] > 0 and stats["nvme_loaded_blocks"] > 0
    assert result["engine"]["tiers"]["nvme"]["path"] == str(tmp_path / "results" / "demo" / "nvme")
    assert sorted(p.name for p in (tmp_path / "results" / "demo").iterdir()) == [
        ".tieredkv-results", "blocks.png", "result.json", "throughput.png", "ttft_cdf.png"]


def test_from_yaml_takes_paths_from_the_config_folder(tmp_path, monkeypatch):
    from tieredkv import LLM

    config = write_config(tmp_path / "experiments", cache={**ENGINE["cache"], "nvme_path": "store",
                                                           "nvme_bytes": "4MiB"}, scheduler={"cost_model": COST})
    monkeypatch.chdir(tmp_path)
    with LLM.from_yaml(os.path.relpath(config)) as llm:
        assert llm.config.cache.nvme_path == str(tmp_path / "experiments" / "store")
