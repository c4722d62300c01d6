"""`tieredkv bench` against the real `tieredkv serve` application on a free loopback port: the
workload of a YAML file (multi-turn, and a Mooncake trace) replayed over HTTP, its result.json in
`tieredkv run`'s schema and plots, every count equal to the server's own /metrics counters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.http_server import running_server
from tieredkv import AsyncLLM
from tieredkv.cli import main
from tieredkv.experiment.results import validate

ENGINE = dict(block_size=16, num_gpu_blocks=128, max_num_seqs=16, max_num_batched_tokens=512)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MULTI_TURN = """name: bench_turns
model: tiny-llama
workload: {kind: multi_turn, users: 3, turns: 3, system_prompt_tokens: 40, message_tokens: 12, max_tokens: 5,
           rate: 20, seed: 1}
slo: {ttft_p90_ms: 60000, itl_p99_ms: 60000}
"""
MOONCAKE = """name: bench_trace
model: tiny-llama
workload: {kind: replay, path: mooncake_conversation_slice.jsonl, max_input_tokens: 1500, max_output_tokens: 4,
           max_requests: 5, rate: 50, seed: 0}
"""


@pytest.fixture(scope="module")
def server():
    with running_server(AsyncLLM(model="tiny-llama", **ENGINE), "tiny-llama") as running:
        yield running


def bench(server, tmp_path, text: str) -> dict:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    before = server.settled()
    assert main(["bench", str(config), "--base-url", server.url, "--out", str(tmp_path), "--no-progress"]) == 0
    after = server.settled()
    result = json.loads(next(tmp_path.glob("*-bench/result.json")).read_text())
    validate(result)
    result["server_grew"] = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("vllm:")}
    return result


def test_bench_agrees_with_the_servers_counters(server, tmp_path, capsys):
    result = bench(server, tmp_path, MULTI_TURN)
    grew, summary, requests = result["server_grew"], result["summary"], result["requests"]
    assert "TTFT p50 / p90 / p99" in capsys.readouterr().out
    assert summary["requests"] == len(requests) == 9 and summary["errors"] == 0
    assert grew['vllm:request_success_total{finished_reason="length"}'] == 9
    assert summary["output_tokens"] == grew["vllm:generation_tokens_total"] == 9 * 5
    assert summary["prompt_tokens"] == grew["vllm:prompt_tokens_total"]
    assert summary["cached_tokens"] == grew["vllm:prefix_cache_hits_total"] > 0  # later turns hit
    assert all(len(r["output_token_ids"]) == len(r["token_times"]) == 5 for r in requests)
    # each later turn's prompt holds the earlier turn's answer: the server saw it grow by it
    turns = {r["tag"]: r for r in requests}
    assert turns["user0/turn1"]["prompt_tokens"] == turns["user0/turn0"]["prompt_tokens"] + 5 + 12
    for figure in ("ttft_s", "tpot_s", "itl_s", "e2el_s"):
        assert 0 < summary[figure]["p50"] <= summary[figure]["p99"]
    assert result["metrics"]["completed"] == 9 and result["metrics"]["output_throughput"] > 0
    assert result["slo"]["met"] is True and set(result["slo"]["measured"]) == {"ttft_p90_ms", "itl_p99_ms"}
    assert summary["stats"]["requests_finished"] >= 9  # the server's stats, from its /metrics
    assert result["timeline"] and "gpu_blocks_used" in result["timeline"][0]
    folder = tmp_path / "bench_turns-bench"
    assert (folder / "ttft_cdf.png").stat().st_size > 0 and (folder / "throughput.png").stat().st_size > 0


def test_bench_replays_a_mooncake_trace(server, tmp_path):
    shutil.copy(CONFIGS / "mooncake_conversation_slice.jsonl", tmp_path)
    result = bench(server, tmp_path, MOONCAKE)
    assert result["workload"]["kind"] == "replay" and result["workload"]["trace"]["format"] == "mooncake"
    n = result["workload"]["num_requests"]
    assert 1 <= n <= 5 and result["summary"]["requests"] == n and result["summary"]["errors"] == 0
    assert result["summary"]["prompt_tokens"] == result["server_grew"]["vllm:prompt_tokens_total"]
    assert result["summary"]["output_tokens"] == result["server_grew"]["vllm:generation_tokens_total"]


def test_bench_names_an_unreachable_server(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(MULTI_TURN)
    assert main(["bench", str(config), "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path),
                 "--no-progress"]) == 2
    assert "tieredkv: error: --base-url: cannot list the server's models" in capsys.readouterr().err


def test_bench_of_requests_that_all_failed_exits_1(tmp_path, capsys):
    """As `tieredkv run` does; it exited 0 when no request reached the server."""
    config = tmp_path / "config.yaml"
    config.write_text(MULTI_TURN)
    assert main(["bench", str(config), "--base-url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path),
                 "--no-progress"]) == 1
    assert "tieredkv: failed: bench_turns-bench: all 9 of its requests failed" in capsys.readouterr().err


@pytest.mark.parametrize("vocab_size", ["-5", "0", "4"])
def test_bench_names_a_vocab_size_too_small(tmp_path, capsys, vocab_size):
    config = tmp_path / "config.yaml"
    config.write_text(MULTI_TURN)
    assert main(["bench", str(config), "--base-url", "http://127.0.0.1:9", "--model", "m", "--vocab-size", vocab_size,
                 "--out", str(tmp_path), "--no-progress"]) == 2
    assert f"tieredkv: error: --vocab-size: expected an integer >= 5, got {vocab_size}" in capsys.readouterr().err
