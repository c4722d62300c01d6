"""Experiments: every workload kind through AsyncLLM, result.json, plots, --compare."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import yaml

from tieredkv.cli import main
from tieredkv.experiment.harness import run_experiment
from tieredkv.experiment.workloads import make_workload

ENGINE = {"model": "tiny-llama", "cache": {"block_size": 4, "num_gpu_blocks": 48, "cpu_cache_bytes": "128KiB"},
          "scheduler": {"max_num_batched_tokens": 64}}


def write_config(tmp_path, workload: dict, **extra) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "exp", **ENGINE, "workload": workload, **extra}))
    return str(path)


@pytest.mark.parametrize(
    "workload, requests",
    [
        ({"kind": "multi_turn", "users": 3, "turns": 2, "system_prompt_tokens": 20, "message_tokens": 6,
          "first_message_tokens": 30, "max_tokens": 4, "think_time_s": 0.01}, 6),
        ({"kind": "long_doc_qa", "documents": 3, "document_tokens": 40, "questions": 2, "max_tokens": 3}, 6),
        ({"kind": "preemption_storm", "requests": 6, "prompt_tokens": 16, "max_tokens": 24, "rate": 200.0}, 6),
    ],
)
def test_workloads_run_and_record_every_request(tmp_path, workload, requests):
    [summary] = run_experiment(write_config(tmp_path, workload), str(tmp_path / "out"), use_tqdm=False).summaries
    assert summary.requests == requests and summary.errors == 0
    result = json.loads((tmp_path / "out" / "exp" / "result.json").read_text())
    assert len(result["requests"]) == requests
    for r in result["requests"]:
        assert r["ttft"] > 0 and len(r["token_times"]) == workload["max_tokens"]
        assert r["token_times"] == sorted(r["token_times"])
    # later turns and later questions return to a prefix; a storm's generations never do
    returning = {r["tag"] for r in result["requests"] if r["returning"]}
    expected = {"multi_turn": {"user0/turn1", "user1/turn1", "user2/turn1"},
                "long_doc_qa": {"doc0/q1", "doc1/q1", "doc2/q1"}, "preemption_storm": set()}[workload["kind"]]
    assert returning == expected
    assert (summary.ttft_returning_s["p50"] is not None) == bool(expected)
    if workload["kind"] == "multi_turn":  # system prompt + first message, then + answer + message
        lengths = sorted(r["prompt_tokens"] for r in result["requests"])
        assert lengths == [50] * 3 + [50 + 4 + 6] * 3
    assert result["timeline"] and {"gpu_blocks_used", "cpu_blocks_used"} <= set(result["timeline"][0])
    for plot in ("ttft_cdf.png", "throughput.png", "blocks.png"):
        assert (tmp_path / "out" / "exp" / plot).stat().st_size > 0


def test_long_doc_qa_returns_to_documents(tmp_path):
    # seeded arrivals at 2 a second: each document's later questions come 0.5 s or more after its
    # first (sent together, a question taken while its document is half computed hits only that
    # half: 240 tokens of 256 seen on a loaded machine)
    workload = {"kind": "long_doc_qa", "documents": 2, "document_tokens": 64, "questions": 3, "max_tokens": 2,
                "rate": 2.0}
    [summary] = run_experiment(write_config(tmp_path, workload), str(tmp_path / "out"), use_tqdm=False,
                               engine_process=False).summaries
    # every question after the first about a document finds the document's full blocks cached
    assert summary.stats["prefix_hit_tokens"] >= 2 * 2 * 64


def test_replay(tmp_path):
    lines = [{"time": 0.0, "prompt": [5, 6, 7], "max_tokens": 3}, {"time": 0.05, "prompt": [8, 9]},
             {"time": 0.02, "prompt": [10**6]}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    [summary] = run_experiment(write_config(tmp_path, {"kind": "replay", "path": str(trace), "max_tokens": 2}),
                               str(tmp_path / "out"), use_tqdm=False).summaries
    assert summary.requests == 3 and summary.errors == 1  # the token id past the vocabulary, reported alone
    result = json.loads((tmp_path / "out" / "exp" / "result.json").read_text())
    by_tag = {r["tag"]: r for r in result["requests"]}
    assert len(by_tag["line1"]["token_times"]) == 3 and len(by_tag["line2"]["token_times"]) == 2
    assert by_tag["line2"]["arrival"] >= 0.05
    assert "token ids must be integers in [0, " in by_tag["line3"]["error"]


def test_same_seed_same_requests():
    from tieredkv.experiment.workloads import LongDocQAWorkload

    a, b = LongDocQAWorkload(seed=3), LongDocQAWorkload(seed=3)
    assert a == b and make_workload({"kind": "long_doc_qa", "seed": 3}) == a


def test_compare_prints_variants_side_by_side(tmp_path, capsys):
    workload = {"kind": "multi_turn", "users": 2, "turns": 2, "system_prompt_tokens": 16, "message_tokens": 4,
                "max_tokens": 3}
    variants = [{"name": "recompute-only", "cache": {"cpu_cache_bytes": 0}, "scheduler": {"preemption": "recompute"}},
                {"name": "gpu+cpu", "scheduler": {"preemption": "swap"}}]
    config = write_config(tmp_path, workload, variants=variants)
    assert main(["run", config, "--compare", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "exp/recompute-only" in out and "exp/gpu+cpu" in out and "(1.00x)" in out
    assert (tmp_path / "out" / "exp" / "gpu+cpu" / "result.json").exists()


def test_variants_selects_and_orders_a_comparison(tmp_path):
    from tieredkv.experiment.spec import load_experiment

    workload = {"kind": "multi_turn", "users": 1, "turns": 1}
    variants = [{"name": n, "scheduler": {"max_num_seqs": 4}} for n in ("a", "b", "c")]
    config = write_config(tmp_path, workload, variants=variants)
    assert [r.variant for r in load_experiment(config, str(tmp_path), only=["c", "a"]).runs] == ["c", "a"]
    with pytest.raises(ValueError, match="--variants: no variant named 'd'; the file has a, b, c"):
        load_experiment(config, str(tmp_path), only=["a", "d"])
    with pytest.raises(ValueError, match="named twice"):
        load_experiment(config, str(tmp_path), only=["a", "a"])


def test_an_empty_variants_flag_is_an_error_not_the_base_alone(tmp_path, capsys):
    variants = [{"name": "a", "scheduler": {"max_num_seqs": 4}}]
    config = write_config(tmp_path, {"kind": "multi_turn", "users": 1, "turns": 1}, variants=variants)
    assert main(["run", config, "--variants", "", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "--variants: no variant named ''" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["name", "variants[0].name"])
@pytest.mark.parametrize("name", [True, None, 1.5])
def test_a_name_that_yaml_reads_as_no_string_is_an_error(tmp_path, where, name):
    """`name: yes` is true in YAML, `name: null` None: no results folder is named "True"."""
    from tieredkv.experiment.spec import load_experiment

    variants = [{"name": name if where != "name" else "a", "scheduler": {"max_num_seqs": 4}}]
    path = tmp_path / "exp.yaml"
    doc = {"name": name if where == "name" else "exp", **ENGINE,
           "workload": {"kind": "multi_turn", "users": 1, "turns": 1}, "variants": variants}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: expected a string naming a results folder"):
        load_experiment(str(path), str(tmp_path), compare=True)


def test_prometheus_exposes_every_variant_while_it_runs(tmp_path):
    pytest.importorskip("prometheus_client")
    import urllib.request

    from tieredkv.experiment.prometheus import PrometheusExporter

    workload = {"kind": "multi_turn", "users": 2, "turns": 2, "system_prompt_tokens": 16, "message_tokens": 4,
                "max_tokens": 3}
    variants = [{"name": "recompute-only", "cache": {"cpu_cache_bytes": 0}, "scheduler": {"preemption": "recompute"}},
                {"name": "swap", "scheduler": {"preemption": "swap"}}]
    exporter = PrometheusExporter(0, "127.0.0.1")
    try:
        summaries = run_experiment(write_config(tmp_path, workload, variants=variants), str(tmp_path / "out"),
                                   compare=True, use_tqdm=False, exporter=exporter).summaries
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics") as response:
            text = response.read().decode()
    finally:
        exporter.close()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    for summary in summaries:
        v = summary.name
        assert samples[f'tieredkv_requests_total{{outcome="ok",variant="{v}"}}'] == summary.requests == 4
        assert samples[f'tieredkv_output_tokens_total{{variant="{v}"}}'] == summary.output_tokens == 12
        assert samples[f'tieredkv_ttft_seconds_count{{variant="{v}"}}'] == 4
        assert samples[f'tieredkv_itl_seconds_count{{variant="{v}"}}'] == 4 * 2
        # the engine's stats as they were at the end of the variant's run
        assert samples[f'tieredkv_prefix_hit_tokens{{variant="{v}"}}'] == summary.stats["prefix_hit_tokens"]
        for kind, count in summary.stats["preemptions"].items():
            assert samples[f'tieredkv_preemptions{{kind="{kind}",variant="{v}"}}'] == count


def test_prometheus_port_errors_are_clear():
    pytest.importorskip("prometheus_client")
    from tieredkv.experiment.prometheus import PrometheusExporter

    taken = PrometheusExporter(0, "127.0.0.1")
    try:
        with pytest.raises(ValueError, match=f"--prometheus-port {taken.port}: cannot listen"):
            PrometheusExporter(taken.port, "127.0.0.1")
    finally:
        taken.close()


@pytest.mark.parametrize(
    "workload, message",
    [
        ({"kind": "chat"}, "workload.kind: 'chat' is not allowed"),
        ({"kind": "multi_turn", "userz": 3}, "did you mean 'workload.users'"),
        ({"kind": "long_doc_qa", "rate": -1}, "workload.rate: expected requests per second > 0"),
        ({"kind": "replay"}, "a replay needs the JSONL file"),
        ({"kind": "multi_turn", "think_time_s": -1}, "workload.think_time_s: expected a finite number of seconds >= 0"),
        ({"kind": "multi_turn", "first_message_tokens": 0}, "workload.first_message_tokens"),
        # values that used to hang a run or end it with a traceback
        ({"kind": ["multi_turn"]}, r"workload.kind: \['multi_turn'\] is not allowed"),
        ({"kind": "multi_turn", "think_time_s": float("inf")}, "workload.think_time_s: expected a finite number"),
        ({"kind": "multi_turn", "rate": float("nan")}, "workload.rate: expected requests per second > 0"),
        ({"kind": "replay", "path": "t.jsonl", "time_scale": float("inf")}, "workload.time_scale: expected a factor"),
        ({"kind": "replay", "path": "t.jsonl", "speed": float("nan")}, "workload.speed: expected a factor > 0"),
        # sizes that would fill the memory with prompts drawn before the first is sent
        ({"kind": "preemption_storm", "requests": 10**11}, r"workload.requests: expected an integer in \[1, 1000000\]"),
        ({"kind": "long_doc_qa", "document_tokens": 10**9}, r"workload.document_tokens: .* in \[1, 100000000\]"),
        ({"kind": "replay", "path": "t.jsonl", "max_requests": 10**7}, r"workload.max_requests: .* in \[1, 1000000\]"),
        # each in range, together too many
        ({"kind": "preemption_storm", "requests": 10**6, "prompt_tokens": 10**4},
         r"workload: 10,000,000,000 prompt tokens to draw before the first request is sent, more than 100,000,000"),
        ({"kind": "multi_turn", "users": 10**4, "turns": 100, "message_tokens": 1000}, "prompt tokens to draw"),
        ({"kind": "long_doc_qa", "documents": 1000, "questions": 100, "document_tokens": 10**4}, "tokens to draw"),
        ({"kind": "long_context", "requests": 10**4, "max_prompt_tokens": 128000}, "prompt tokens to draw"),
    ],
)
def test_workload_errors(workload, message):
    with pytest.raises(ValueError, match=message):
        make_workload(workload)


def test_compare_needs_variants(tmp_path):
    config = write_config(tmp_path, {"kind": "multi_turn", "users": 1, "turns": 1})
    with pytest.raises(ValueError, match="--compare needs a list of variants"):
        run_experiment(config, str(tmp_path / "out"), compare=True, use_tqdm=False)


def test_every_shipped_config_is_valid():
    from pathlib import Path

    from tieredkv.config import EXPERIMENT_SECTIONS, EngineConfig, read_yaml
    from tieredkv.experiment.spec import variants

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        doc = read_yaml(str(path))
        EngineConfig.from_dict(doc, extra_sections=EXPERIMENT_SECTIONS)
        make_workload(doc["workload"])
        for _, engine_doc in variants(doc, compare="variants" in doc):
            EngineConfig.from_dict(engine_doc)


def test_transformers_peer_serves_the_same_workload(tmp_path):
    """benchmarks/bench_serving_peer.py: the workload through transformers' continuous batching."""
    import importlib.util
    from pathlib import Path

    import transformers

    if not hasattr(transformers, "ContinuousBatchingConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no continuous batching manager (needs >= 5.17)")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving_peer.py"
    spec = importlib.util.spec_from_file_location("bench_serving_peer", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    workload = {"kind": "multi_turn", "users": 2, "turns": 2, "system_prompt_tokens": 20, "message_tokens": 6,
                "first_message_tokens": 10, "max_tokens": 4, "think_time_s": 0.0}
    config = write_config(tmp_path, workload)
    out = tmp_path / "peer" / "result.json"
    assert peer.main([config, "--out", str(out), "--no-progress"]) == 0
    [ours] = run_experiment(config, str(tmp_path / "out"), use_tqdm=False).summaries
    theirs, mine = json.loads(out.read_text()), json.loads((tmp_path / "out" / "exp" / "result.json").read_text())
    assert theirs["name"] == "exp/transformers" and theirs["summary"]["errors"] == 0
    # the same documents, but transformers has no CPU tier whose block trace could be replayed
    assert set(theirs) == set(mine) - {"cpu_tier_replay"} and set(theirs["summary"]) == set(mine["summary"])
    assert set(theirs["requests"][0]) == set(mine["requests"][0])
    # the same requests (a later turn's prompt holds the earlier turns' outputs), each with max_tokens tokens
    assert {(r["tag"], r["prompt_tokens"], r["returning"]) for r in theirs["requests"]} == {
        (r["tag"], r["prompt_tokens"], r["returning"]) for r in mine["requests"]}
    for r in theirs["requests"]:
        assert r["ttft"] > 0 and len(r["token_times"]) == workload["max_tokens"]
        assert r["token_times"] == sorted(r["token_times"])
    assert theirs["summary"]["output_tokens"] == ours.output_tokens == 4 * workload["max_tokens"]
    # its block tables are sized for the longest prompt the workload sends
    assert peer.longest_request(make_workload(workload)) == (max(r["prompt_tokens"] for r in mine["requests"]), 4)
    # turn 1 finds (at least) the whole blocks of its own turn 0 cached: 30 prompt + 4 output tokens, blocks of 4
    assert all(r["cached_tokens"] >= 32 for r in theirs["requests"] if r["returning"])
    assert theirs["engine"]["peer"]["requested"]["num_blocks"] == ENGINE["cache"]["num_gpu_blocks"]


class RecordingClient:
    """Answers every request at once with `max_tokens` tokens; records when each was sent."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[float, list[int]]] = {}

    async def request(self, prompt, max_tokens, tag, returning=False):
        self.sent[tag] = (asyncio.get_running_loop().time(), prompt)
        return [5] * max_tokens


def test_multi_turn_users_arrive_at_a_rate():
    """With a `rate`, users start at Poisson times (mean gap 1/rate) and send the same
    conversations as without one."""
    spec = {"users": 6, "turns": 2, "system_prompt_tokens": 8, "message_tokens": 4, "max_tokens": 2}

    def run(**extra):
        client = RecordingClient()

        async def main():
            start = asyncio.get_running_loop().time()
            await make_workload({"kind": "multi_turn", **spec, **extra}).run(client, vocab_size=512)
            return {tag: (t - start, prompt) for tag, (t, prompt) in client.sent.items()}

        return asyncio.run(main())

    at_once, paced = run(), run(rate=20.0)
    assert {tag: p for tag, (_, p) in at_once.items()} == {tag: p for tag, (_, p) in paced.items()}
    assert max(t for t, _ in at_once.values()) < 0.05
    firsts = sorted(paced[f"user{u}/turn0"][0] for u in range(6))
    assert firsts[-1] > 0.05 and len(set(firsts)) == 6  # six distinct arrival times, spread out
