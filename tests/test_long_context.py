"""The long-context workload: heavy-tailed prompt lengths, shared document prefixes, Poisson
arrivals, its checked keys, and a run end to end with a tiny model under both schedulings."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from tieredkv.config import read_yaml
from tieredkv.experiment.harness import run_experiment
from tieredkv.experiment.results import validate
from tieredkv.experiment.spec import variants
from tieredkv.experiment.workloads import LongContextWorkload, make_workload

SMALL = {"kind": "long_context", "requests": 10, "median_prompt_tokens": 48, "sigma": 1.0, "min_prompt_tokens": 20,
         "max_prompt_tokens": 240, "documents": 2, "shared_fraction": 0.6, "question_tokens": 6, "max_tokens": 4,
         "rate": 40.0, "seed": 3}


def test_lengths_are_clipped_lognormal_and_the_same_seed_sends_the_same_requests():
    workload = make_workload({**SMALL, "requests": 400})
    plan = workload.plan(vocab_size=1000)
    lengths = [len(prompt) for _, _, prompt, _ in plan]
    assert min(lengths) == 20 and max(lengths) == 240  # both clips are reached
    assert 40 <= sorted(lengths)[200] <= 56  # the median
    assert sum(lengths) / len(lengths) > 60  # the tail pulls the mean above it
    times = [t for t, *_ in plan]
    assert times == sorted(times) and 400 / times[-1] == pytest.approx(40, rel=0.15)
    assert workload.plan(vocab_size=1000) == plan
    assert make_workload({**SMALL, "requests": 400, "seed": 4}).plan(vocab_size=1000) != plan
    assert all(t == 0 for t, *_ in make_workload({**SMALL, "rate": None}).plan(vocab_size=1000))


def test_requests_on_one_document_share_its_first_tokens():
    plan = make_workload({**SMALL, "requests": 60}).plan(vocab_size=1000)
    by_doc: dict[str, list[list[int]]] = {}
    for _, tag, prompt, returning in plan:
        doc = tag.partition("/")[2]
        assert returning == bool(doc and doc in by_doc)  # a document sent before
        by_doc.setdefault(doc, []).append(prompt)
    assert set(by_doc) == {"", "doc0", "doc1"} and 14 < len(by_doc[""]) < 34  # 40% of 60
    for doc in ("doc0", "doc1"):
        prompts = by_doc[doc]
        for a, b in zip(prompts, prompts[1:], strict=False):
            shared = min(len(a), len(b)) - 6  # all but the question of the shorter one
            assert a[:shared] == b[:shared] and a[shared:][:6] != b[shared:][:6]
    firsts = [prompts[0][:14] for prompts in by_doc.values()]
    assert len({tuple(f) for f in firsts}) == 3  # documents differ from each other and from the rest


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"median_prompt_tokens": 10}, "workload.median_prompt_tokens: 10 is outside"),
        ({"min_prompt_tokens": 0}, "workload.min_prompt_tokens: expected an integer in \\[1, 100000000\\], got 0"),
        ({"question_tokens": 20}, "workload.question_tokens: 20 leaves no document"),
        ({"sigma": -1}, r"workload.sigma: expected a number in \[0, 4\]"),
        ({"shared_fraction": 1.5}, r"workload.shared_fraction: expected a number in \[0, 1\]"),
        ({"documents": 0}, "workload.documents: expected an integer in \\[1, 1000000\\], got 0"),
        ({"rate": 0}, "workload.rate: expected requests per second > 0"),
        ({"median_prompt_token": 5}, "did you mean 'workload.median_prompt_tokens'"),
    ],
)
def test_bad_keys_name_themselves(keys, message):
    with pytest.raises(ValueError, match=message):
        make_workload({**SMALL, **keys})


def test_runs_end_to_end_with_the_same_tokens_under_both_schedulings(tmp_path):
    config = {"name": "lc", "model": "tiny-llama", "device": "cpu", "dtype": "float32",
              "cache": {"block_size": 4, "num_gpu_blocks": 256},
              "scheduler": {"max_num_batched_tokens": 32, "scheduling_policy": "ttft", "preemption": "recompute"},
              "workload": {**SMALL, "requests": 6, "median_prompt_tokens": 32, "min_prompt_tokens": 12,
                           "max_prompt_tokens": 150},
              "variants": [{"name": "fcfs", "scheduler": {"scheduling_policy": "fcfs"}}, {"name": "ttft"}]}
    path = tmp_path / "lc.yaml"
    path.write_text(yaml.safe_dump(config))
    summaries = run_experiment(str(path), str(tmp_path / "out"), compare=True, use_tqdm=False).summaries
    assert [(s.requests, s.errors) for s in summaries] == [(6, 0), (6, 0)]
    outputs = []
    for variant in ("fcfs", "ttft"):
        result = json.loads((tmp_path / "out" / "lc" / variant / "result.json").read_text())
        validate(result)
        assert result["workload"]["kind"] == "long_context"
        assert result["engine"]["config"]["scheduler"]["scheduling_policy"] == variant
        outputs.append({r["tag"]: r["output_token_ids"] for r in result["requests"]})
        assert all(len(tokens) == 4 for tokens in outputs[-1].values())
    assert outputs[0] == outputs[1]  # the order of the work changes no token
    assert isinstance(make_workload(SMALL), LongContextWorkload)


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/bench_scheduling.py as a module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scheduling.py"
    spec = importlib.util.spec_from_file_location("bench_scheduling", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_simulated_benchmark_serves_short_prompts_before_a_long_one(bench):
    """benchmarks/bench_scheduling.py --sim on four requests: a 60k-token prompt, then three of
    2k tokens 0.1 s later. fcfs makes them wait for the long prefill (~4 s on the simulated
    H200); ttft serves them first, and the work takes as long."""
    engines = dict(variants(read_yaml(str(bench.DEFAULT_CONFIG)), compare=True))
    requests = [(0.0, "long", list(range(60_000)), False, 4)]
    requests += [(0.1, f"short{i}", [i] * 2048, False, 4) for i in range(3)]
    ttft, wall = {}, {}
    for name in ("long_context_8b/fcfs", "long_context_8b/ttft"):
        records, wall[name], _ = bench.simulate(engines[name], requests, bench.H200_LLAMA_8B)
        ttft[name] = {r.tag: r.ttft for r in records}
    fcfs, new = ttft["long_context_8b/fcfs"], ttft["long_context_8b/ttft"]
    assert min(fcfs[f"short{i}"] for i in range(3)) > 3.0 and max(new[f"short{i}"] for i in range(3)) < 0.5
    assert new["long"] < fcfs["long"] + 0.5
    assert wall["long_context_8b/ttft"] == pytest.approx(wall["long_context_8b/fcfs"], rel=0.02)


def test_the_simulated_benchmark_swaps_to_the_configs_cpu_tier(bench):
    """--sim with the config's CPU tier (16 GiB: 8,192 blocks of llama-3-8b's 2 MiB): two 32k-token
    prompts fill 64k tokens of GPU blocks and outgrow them while they decode; one is swapped
    out and back, and everything finishes."""
    engine = {"model": "llama-3-8b", "cache": {"block_size": 16, "num_gpu_blocks": 4096, "cpu_cache_bytes": "16GiB"},
              "scheduler": {"max_num_batched_tokens": 8192, "preemption": "swap"}}
    requests = [(0.0, f"long{i}", [i + 1] * 32_000, False, 800) for i in range(2)]
    records, _, stats = bench.simulate(engine, requests, bench.H200_LLAMA_8B)
    assert all(r.finished and len(r.token_times) == 800 for r in records)
    assert stats["swap_preemptions"] == 1 and stats["recompute_preemptions"] == 0 and stats["loop_schedule_s"] > 0


def test_the_simulated_benchmark_reads_back_from_a_simulated_disk(bench):
    """--sim with a store below the CPU tier (`SimDisk`, here as fast as an NVMe array, so that
    loads pay at any depth): a 2k-token prompt pushed out of the GPU and the 1 GiB LRU CPU tier
    by eight others is read back from the disk when it comes again, on the simulated clock."""
    engine = {"model": "llama-3-8b", "cache": {"block_size": 16, "num_gpu_blocks": 256, "cpu_cache_bytes": "1GiB",
                                               "nvme_path": "unused", "nvme_bytes": "8GiB", "cpu_policy": "lru"},
              "scheduler": {"max_num_batched_tokens": 8192}}
    prompt = list(range(1, 2001))
    requests = [(0.0, "first", prompt, False, 4)]
    requests += [(1.0 + i, f"other{i}", [10_000 * (i + 1) + j for j in range(2000)], False, 4) for i in range(8)]
    requests += [(20.0, "again", [*prompt, 7], False, 4)]
    records, _, stats = bench.simulate(engine, requests, bench.H200_LLAMA_8B, disk_bytes_per_s=28e9)
    assert all(r.finished for r in records)
    assert stats["disk_reads"] > 10 and stats["loaded_blocks"] == stats["disk_reads"]
    again = next(r for r in records if r.tag == "again")
    assert again.cached_tokens >= 16 * stats["loaded_blocks"] >= 1500  # read back before its turn: its prefix


def a_prompt_back_from_the_cpu_tier() -> tuple[dict, list]:
    """An engine with a 1 GiB LRU CPU tier, and a 2k-token prompt pushed out of its GPU by three
    others that comes again (`again`) at 20 s, when the CPU tier still holds it."""
    engine = {"model": "llama-3-8b", "cache": {"block_size": 16, "num_gpu_blocks": 256, "cpu_cache_bytes": "1GiB",
                                               "cpu_policy": "lru"},
              "scheduler": {"max_num_batched_tokens": 8192}}
    prompt = list(range(1, 2001))
    requests = [(0.0, "first", prompt, False, 4)]
    requests += [(1.0 + i, f"other{i}", [10_000 * (i + 1) + j for j in range(2000)], False, 4) for i in range(3)]
    requests += [(20.0, "again", [*prompt, 7], False, 4)]
    return engine, requests


def test_the_simulated_benchmark_replays_the_stream_its_cpu_tier_served_under_every_policy(bench, monkeypatch):
    """`--replay-policies`: the CPU tier's block trace of a simulated run, replayed under every
    replacement policy. A 2k-token prompt pushed out of the GPU by three others stays in the
    1 GiB LRU CPU tier and hits there when it comes again: the replay finds that hit."""
    engine, requests = a_prompt_back_from_the_cpu_tier()
    records, _, stats = bench.simulate(engine, requests, bench.H200_LLAMA_8B)
    assert "cpu_tier_replay" not in stats
    records, _, stats = bench.simulate(engine, requests, bench.H200_LLAMA_8B, replay_policies=True)
    again = next(r for r in records if r.tag == "again")
    assert again.cached_tokens >= 1984  # its 124 full blocks, from the CPU tier
    replayed = stats["cpu_tier_replay"]
    assert replayed["capacity_blocks"] == 512
    rates = replayed["hit_rate"]
    assert set(rates) == {"lru", "tinylfu", "adaptive", "arc", "wtinylfu", "belady"}
    assert replayed["requested_blocks"] * rates["lru"] >= 124  # the tier served that hit; the replay finds it
    assert rates["belady"] == max(rates.values())
    config = str(Path(bench.__file__).resolve().parents[1] / "configs" / "long_context_8b.yaml")
    monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, "--replay-policies"])
    with pytest.raises(SystemExit, match="add --sim"):
        bench.main()


def test_the_simulated_loop_pays_for_the_copy_jobs_it_submits(bench):
    """`--transfer-host-ms`: each CPU-tier copy job costs the loop its time before the step's
    launch. The prompt found in the CPU tier again is copied in by an H2D job: at 0.5 s a job,
    its first token comes at least 0.5 s later; D2H jobs cost nothing here."""
    engine, requests = a_prompt_back_from_the_cpu_tier()
    ttft = {}
    for job_s in ((0.0, 0.0), (0.0, 0.5)):
        cost = dataclasses.replace(bench.H200_LLAMA_8B, transfer_job_s=job_s)
        records, _, _ = bench.simulate(engine, requests, cost)
        ttft[job_s] = next(r for r in records if r.tag == "again").ttft
    assert ttft[0.0, 0.5] >= ttft[0.0, 0.0] + 0.5


def test_the_simulated_benchmark_plans_the_questions_about_documents(bench):
    """A `long_doc_qa` workload on the simulated clock: its requests, as `run` sends them."""
    doc = {"workload": {"kind": "long_doc_qa", "documents": 2, "document_tokens": 32, "questions": 2, "rate": 1.0}}
    plan = bench.plan_of(bench.workload_of(doc, None))
    assert [(tag, returning) for _, tag, _, returning, _ in plan] == [
        ("doc0/q0", False), ("doc1/q0", False), ("doc0/q1", True), ("doc1/q1", True)]
    assert plan[0][2][:32] == plan[2][2][:32] and plan[0][2][32:] != plan[2][2][32:]
    assert [t for t, *_ in plan] == sorted({t for t, *_ in plan})


def test_a_document_revisited_on_an_idle_engine_reads_its_later_part_while_computing_the_rest(bench):
    """On a 1.5 GB/s disk no block of a 1.5k-token document pays to load on its own (1.4 ms a
    block against ~0.5 ms to compute it), but with no other request queued the engine reads
    the document's last blocks while it computes the first ones, and the revisit's first
    token comes sooner than the first visit's."""
    engine = {"model": "llama-3-8b", "cache": {"block_size": 16, "num_gpu_blocks": 256, "cpu_cache_bytes": "1GiB",
                                               "nvme_path": "unused", "nvme_bytes": "8GiB", "cpu_policy": "lru"},
              "scheduler": {"max_num_batched_tokens": 8192}}
    document = list(range(1, 1537))
    requests = [(0.0, "first", [*document, 3], False, 4)]
    requests += [(1.0 + i, f"other{i}", [10_000 * (i + 1) + j for j in range(1536)], False, 4) for i in range(10)]
    requests += [(20.0, "again", [*document, 7], False, 4)]
    records, _, stats = bench.simulate(engine, requests, bench.H200_LLAMA_8B, disk_bytes_per_s=1.5e9)
    first, again = (next(r for r in records if r.tag == tag) for tag in ("first", "again"))
    assert 0 < stats["loaded_blocks"] < 96 // 2  # its tail: most of it is computed
    assert again.cached_tokens == 16 * stats["loaded_blocks"]
    assert again.ttft < first.ttft


def test_a_loop_ahead_of_the_gpu_waits_for_a_documents_reads_rather_than_compute_them(bench, monkeypatch):
    """With the loop's launch time given, the simulated loop schedules ahead of the GPU through
    the chunks that sample nothing, as the engine does: a revisited 16k-token document reaches
    its later blocks, still being read, while the GPU still computes the chunks before them.
    Weighed behind that queue (`Scheduler.launched`), the reads are waited for; weighed
    behind an empty one, they look late and their blocks are computed, and the revisits gain
    less. (long_docs_revisited_8b with two questions a document.)"""
    doc = read_yaml(Path(bench.__file__).resolve().parents[1] / "configs" / "long_docs_revisited_8b.yaml")
    doc["workload"]["questions"] = 2
    [(_, engine)] = bench.engines_of(doc, "gpu+cpu8GiB+nvme", None, None, [])
    requests = bench.plan_of(bench.workload_of(doc, None))
    cost = dataclasses.replace(bench.H200_LLAMA_8B, host_s_per_token=1e-6)
    seen = bench.simulate(engine, requests, cost, disk_bytes_per_s=1.5e9)

    class Blind(bench.Scheduler):  # the GPU's queue unseen
        def __init__(self, config, kv, policy, launched=None):
            super().__init__(config, kv, policy)

    monkeypatch.setattr(bench, "Scheduler", Blind)
    blind = bench.simulate(engine, requests, cost, disk_bytes_per_s=1.5e9)
    assert blind[2]["late_loads"] > 1000 and seen[2]["late_loads"] < 0.01 * blind[2]["late_loads"]
    returning = [sorted(r.ttft for r in records if r.returning) for records, _, _ in (seen, blind)]
    assert statistics.median(returning[0]) < 0.95 * statistics.median(returning[1])


def test_the_launch_time_takes_the_simulated_clock_and_a_number(bench, monkeypatch):
    config = str(Path(bench.__file__).resolve().parents[1] / "configs" / "long_context_8b.yaml")
    for argv, error in ((["--host-us-per-token", "2"], "add --sim"),
                        (["--sim", "--host-us-per-token", "-1"], "--host-us-per-token: expected a number >= 0"),
                        (["--sim", "--launch-waits", "0.3"], "add --host-us-per-token or --launch-from"),
                        (["--launch-from", "run.json"], "add --sim"),
                        (["--sim", "--launch-from", "run.json", "--host-us-per-token", "1"],
                         "drop --host-us-per-token"),
                        (["--sim", "--host-us-per-token", "1", "--launch-waits", "1.5"],
                         "--launch-waits: expected a share from 0 to 1")):
        monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, *argv])
        with pytest.raises(SystemExit, match=error):
            bench.main()


def test_each_variant_takes_the_launch_time_its_run_measured(bench, tmp_path):
    """`--launch-from`: the fixed and per-token launch time each variant's `tieredkv run`
    measured, by the variant its result.json names; a variant with none, or a file without them,
    is an error that says so. The simulated loop then launches a step after both parts."""
    paths = []
    for name, fit in (("gpu+cpu8GiB", (0.5e-3, 0.4e-6)), ("gpu+cpu8GiB+nvme", (3e-3, 1e-6))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"name": f"multi_turn_8b/{name}", "summary": {"stats": {
            "launch_s_fixed": fit[0], "launch_s_per_token": fit[1]}}}))
        paths.append(str(path))
    fits = bench.launch_fits(paths, ["gpu+cpu8GiB+nvme", "gpu+cpu8GiB"])
    assert fits == {"gpu+cpu8GiB": (0.5e-3, 0.4e-6), "gpu+cpu8GiB+nvme": (3e-3, 1e-6)}
    with pytest.raises(SystemExit, match="no run of recompute-only among those given"):
        bench.launch_fits(paths, ["recompute-only"])
    (tmp_path / "bare.json").write_text(json.dumps({"name": "multi_turn_8b/x", "summary": {"stats": {}}}))
    with pytest.raises(SystemExit, match="not a result.json of `tieredkv run` with the loop's launch time"):
        bench.launch_fits([str(tmp_path / "bare.json")], ["x"])
    gpu = bench.SimLaunched(lambda: 0.0, host_s_per_token=1e-6, host_s_per_step=3e-3)
    assert gpu.launch(1000, 1000, 0.1) == (pytest.approx(0.104), pytest.approx(0.004))


def test_the_simulation_refuses_a_request_longer_than_the_gpu_tier_and_serves_the_rest(bench):
    """As the engine refuses it (`RequestLimits`): admitted, it could never run, and every
    request behind it would wait for ever (a slice of the synthetic trace has 191k-token prompts
    against a 131k-token GPU tier)."""
    doc = read_yaml(Path(bench.__file__).resolve().parents[1] / "configs" / "multi_turn_8b.yaml")
    [(_, engine)] = bench.engines_of(doc, "gpu+cpu8GiB", None, None, [])
    gpu_tokens = engine["cache"]["num_gpu_blocks"] * engine["cache"]["block_size"]
    requests = [(0.0, "long", [1] * gpu_tokens, False, 16), (0.0, "short", list(range(1, 100)), False, 4)]
    records, _, stats = bench.simulate(engine, requests, bench.H200_LLAMA_8B)
    by_tag = {r.tag: r for r in records}
    assert by_tag["long"].error and not by_tag["long"].token_times and stats["refused"] == 1
    assert by_tag["short"].error is None and len(by_tag["short"].token_times) == 4


def test_a_full_kernel_queue_holds_the_loop_until_the_gpu_has_run_part_of_the_step(bench):
    """On the GPU a launch call returns once the queue of kernels has room: with nothing queued,
    after the share `launch_waits` of its step has run; behind another step, after that one and
    the same share of its own. A decode step (one graph) never waits."""
    now = [0.0]
    gpu = bench.SimLaunched(lambda: now[0], host_s_per_token=1e-6, launch_waits=0.3)
    end, returned = gpu.launch(1000, 1000, 0.1)  # launched at 1 ms
    assert end == pytest.approx(0.101) and returned == pytest.approx(0.031)
    now[0] = returned
    end, returned = gpu.launch(1000, 1000, 0.1)  # behind the first, which ends at 101 ms
    assert end == pytest.approx(0.201) and returned == pytest.approx(0.131)
    assert gpu.launch(8, 0, 0.01)[1] == pytest.approx(0.031 + 8e-6)
    never_full = bench.SimLaunched(lambda: 0.0, host_s_per_token=1e-6)
    assert never_full.launch(1000, 1000, 0.1)[1] == pytest.approx(0.001)


def test_the_simulated_disk_reads_beside_its_writes(bench):
    """A read submitted while writes are moving finishes one block's time later, as on the GPU
    machine's disk (a read behind 1 to 8 writes took 14.9-16.3 ms against 17.2 alone); the
    writes move one at a time meanwhile."""
    now = [0.0]
    disk = bench.SimDisk(capacity=8, block_bytes=1000, bytes_per_s=1e6, clock=lambda: now[0])  # 1 ms a block
    ref = bench.BlockRef(1, 0, [0])
    first, second = disk.submit_write(ref, None), disk.submit_write(bench.BlockRef(2, 1, [0]), None)
    now[0] = 0.0005
    read = disk.submit_read(ref, None)
    assert disk.next_finish() == pytest.approx(0.001)  # the first write
    now[0] = 0.0015
    assert sorted(job for job, ok in disk.poll()) == [first, read]
    now[0] = 0.002
    assert [job for job, ok in disk.poll()] == [second]
    assert disk.next_finish() is None


def test_perturbed_runs_time_each_step_anew_and_are_averaged(bench, tmp_path, monkeypatch, capsys):
    """`--perturb 1,1.002`: each workload runs under each step time (the 0.2% longer one ends
    later), and the variants' ratios are averaged over both runs."""
    out = tmp_path / "runs.json"
    config = str(Path(bench.__file__).resolve().parents[1] / "configs" / "long_context_8b.yaml")
    monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, "--sim", "--requests", "6",
                                      "--policies", "fcfs,ttft", "--perturb", "1,1.002", "--json", str(out)])
    bench.main()
    runs = json.loads(out.read_text())
    assert [r["name"] for r in runs] == ["fcfs", "ttft", "fcfs", "ttft"]
    assert runs[2]["elapsed_s"] > runs[0]["elapsed_s"]
    assert "geometric mean over 2 runs" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, "--sim", "--perturb", "1,-1"])
    with pytest.raises(SystemExit, match="positive factors"):
        bench.main()


def test_a_longer_fixed_step_time_slows_the_simulated_clock(bench, tmp_path, monkeypatch):
    """`--step-ms`: every step takes that much fixed time (the preset's unless given)."""
    config = str(Path(bench.__file__).resolve().parents[1] / "configs" / "long_context_8b.yaml")
    elapsed = {}
    for step_ms in (None, 9.0):
        out = tmp_path / f"{step_ms}.json"
        step = ["--step-ms", str(step_ms)] if step_ms else []
        monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, "--sim", "--requests", "6", "--policies",
                                          "ttft", "--json", str(out), *step])
        bench.main()
        elapsed[step_ms] = json.loads(out.read_text())[0]["elapsed_s"]
    assert elapsed[9.0] > elapsed[None]
    monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, "--step-ms", "9"])
    with pytest.raises(SystemExit, match="add --sim"):
        bench.main()
    monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, "--sim", "--step-ms", "0"])
    with pytest.raises(SystemExit, match="--step-ms: expected a positive number"):
        bench.main()


def test_a_multi_turn_run_replays_open_loop_with_its_answers(bench, tmp_path):
    """`--arrivals`: each turn of a multi_turn run is sent when it was (its time divided by the
    speed), its prompt the conversation so far with the answers the run gave; a run of another
    workload, or one with a turn that did not finish, is refused."""
    from tieredkv.experiment.workloads import describe_workload

    section = {"kind": "multi_turn", "users": 2, "turns": 2, "system_prompt_tokens": 3, "message_tokens": 2,
               "max_tokens": 2, "rate": 1.0, "seed": 5}
    workload = make_workload(section)
    answers = {f"user{u}/turn{t}": [10 * u + t, 99] for u in range(2) for t in range(2)}
    sent = {"user0/turn0": 0.5, "user0/turn1": 2.0, "user1/turn0": 1.0, "user1/turn1": 1.5}
    run = {"workload": describe_workload(workload),
           "requests": [{"tag": tag, "arrival": sent[tag], "finished": True, "output_token_ids": answers[tag]}
                        for tag in sent]}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(run))
    requests = bench.plan_of_run({"workload": section}, str(path), speed=2.0)
    assert [(r[0], r[1]) for r in requests] == [(0.25, "user0/turn0"), (0.5, "user1/turn0"),
                                                (0.75, "user1/turn1"), (1.0, "user0/turn1")]
    first, second = {r[1]: r[2] for r in requests}["user0/turn0"], {r[1]: r[2] for r in requests}["user0/turn1"]
    assert len(first) == 5 and second[:5] == first and second[5:7] == answers["user0/turn0"] and len(second) == 9
    assert [r[3] for r in requests] == [False, False, True, True] and {r[4] for r in requests} == {2}
    with pytest.raises(SystemExit, match="not the config's"):
        bench.plan_of_run({"workload": {**section, "seed": 6}}, str(path), None)
    run["requests"][1]["finished"] = False
    path.write_text(json.dumps(run))
    with pytest.raises(SystemExit, match="user0/turn1 did not finish"):
        bench.plan_of_run({"workload": section}, str(path), None)
    with pytest.raises(SystemExit, match="replays a multi_turn run"):
        bench.plan_of_run({"workload": SMALL}, str(path), None)


def test_a_replayed_run_takes_no_flag_that_draws_other_requests(bench, monkeypatch):
    config = str(Path(bench.__file__).resolve().parents[1] / "configs" / "multi_turn_8b.yaml")
    monkeypatch.setattr(sys, "argv", ["bench_scheduling.py", config, "--sim", "--arrivals", "result.json",
                                      "--rates", "1", "--seeds", "0,1"])
    with pytest.raises(SystemExit, match="--arrivals replays a run's own requests: drop --rates, --seeds"):
        bench.main()
