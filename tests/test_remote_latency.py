"""A remote tier far away (high latency, decent bandwidth) is not waited for when its round trip
costs more than computing the blocks; near, the same blocks are loaded. Real redis-server,
reached through a loopback relay that delays requests; tokens exact either way."""

from __future__ import annotations

import pytest

from tests.remote_link import SlowLink
from tests.remote_worker import GREEDY, LOAD_WINS, NEW_TOKENS, prompts, remote_llm


@pytest.fixture
def expected(reference_outputs):
    return reference_outputs("tiny-llama", prompts(), NEW_TOKENS)


def run(url: str, latency_s: float) -> tuple[list[list[int]], dict, dict]:
    cost = {**LOAD_WINS, "disk_read_bytes_per_s": 50e6, "read_latency_s": latency_s}  # 50 MB/s: 40 us a block
    with remote_llm(url, scheduler={"cost_model": cost}) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        return tokens, llm.stats(), dict(llm.scheduler.loads.lower_prefix_blocks)


def test_a_distant_remote_tier_is_recomputed_and_a_near_one_loaded(redis_server, expected):
    with remote_llm(redis_server.url) as llm:  # fills the server
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == expected
    # 1 ms of prefill a token: a block of 4 costs 4 ms; a load's round trip of 50 ms never pays
    with SlowLink(redis_server.port, bytes_per_s=50e6, latency_s=0.005) as link:
        far, far_stats, far_plan = run(link.url, latency_s=0.05)
    assert far == expected
    assert far_plan["compute"] > 0 and far_plan["load"] == 0 and far_stats["remote_hit_blocks"] == 0
    near, near_stats, near_plan = run(redis_server.url, latency_s=0.0)
    assert near == expected
    assert near_plan["load"] > 0 and near_stats["remote_hit_blocks"] > 0
