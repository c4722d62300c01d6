"""The remote tier inside the engine, against a real redis-server: exact tokens (transformers')
when prefixes come from the server, from another engine process, after the server restarted
empty; each fault costs a recompute, is counted, and the tier is used again afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, wait_until
from tests.remote_worker import BLOCK_BYTES, GREEDY, LOAD_WINS, NEW_TOKENS, prompts, remote_llm
from tieredkv import LLM
from tieredkv.config import EngineConfig
from tieredkv.engine_core.info import EngineInfo
from tieredkv.serve.server import startup_report
from tieredkv.tiers.remote import connection

ROOT = Path(__file__).resolve().parents[1]


def generate(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def settled_stats(llm: LLM, idle_steps: int = 8) -> dict:
    """Stats once the engine, idle, spilled what it had to (spill-ahead runs at each step)
    and the writes in flight have finished."""
    for _ in range(idle_steps):
        llm.step()
    wait_until(lambda: llm.stats()["remote_in_flight"] == 0, what="writes done")
    llm.step()  # books the finished writes
    return llm.stats()


@pytest.fixture
def expected(reference_outputs):
    return reference_outputs("tiny-llama", prompts(), NEW_TOKENS)


@pytest.mark.parametrize("with_nvme", [False, True])
def test_prefixes_come_back_from_the_remote_tier(redis_server, tmp_path, expected, with_nvme):
    nvme = {"nvme_bytes": "4MiB", "io_backend": "sync"} if with_nvme else {}
    with remote_llm(redis_server.url, **({"nvme_path": str(tmp_path / "a")} if nvme else {}), **nvme) as llm:
        assert generate(llm) == expected
        report = dict(line.split("  ", 1) for line in startup_report(EngineInfo.of(llm)).splitlines())
    stats = llm.stats()  # closed: every write done, those at shutdown too
    assert report["remote tier"].strip() == f"{redis_server.url}, connected, storing what the server keeps"
    assert (report["NVMe tier"].strip() == "none") != with_nvme and ("nvme_slots_total" in stats) == with_nvme
    assert stats["remote_stored_blocks"] > 0 and stats["remote_errors"] == 0
    assert len(redis_server.block_keys()) == stats["remote_stored_blocks"]
    if with_nvme:  # writes go to both tiers
        assert stats["nvme_spilled_blocks"] > 0 and stats["nvme_slots_used"] > 0
    # a new engine (an empty NVMe store beside it) finds them on the server
    with remote_llm(redis_server.url, **({"nvme_path": str(tmp_path / "b")} if nvme else {}), **nvme) as llm:
        assert generate(llm) == expected
        stats = llm.stats()
    assert stats["remote_hit_blocks"] > 0 and stats["remote_errors"] == 0
    assert stats["nvme_loaded_blocks"] == stats["remote_hit_blocks"] + (stats["nvme_hits"] if with_nvme else 0)


def run_workers(url: str, rounds: int, count: int) -> list[dict]:
    """`count` engine processes at once, each running the prompts `rounds` times."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.remote_worker", url, str(rounds)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"engine process failed:\n{err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_a_second_engine_process_reuses_the_prefixes_of_the_first(redis_server, expected):
    (first,) = run_workers(redis_server.url, rounds=1, count=1)
    assert first["outputs"] == [expected] and first["stats"]["remote_stored_blocks"] > 0
    with remote_llm(redis_server.url) as llm:
        assert generate(llm) == expected
        stats = llm.stats()
    assert stats["remote_hit_blocks"] > 0 and stats["remote_errors"] == 0


def test_two_engine_processes_hammering_the_same_prefixes(redis_server, expected):
    results = run_workers(redis_server.url, rounds=2, count=2)
    for result in results:
        assert result["outputs"] == [expected] * 2
        assert result["stats"]["remote_errors"] == 0
    assert sum(r["stats"]["remote_hit_blocks"] for r in results) > 0
    # the same blocks, stored by either engine, are stored once
    assert len(redis_server.block_keys()) <= sum(r["stats"]["remote_stored_blocks"] for r in results)


def damage(server: RedisServer, fault: str) -> None:
    client = server.client()
    keys = server.block_keys()
    assert keys, "nothing was stored to damage"
    if fault == "flushall":
        client.flushall()
    for key in keys:
        if fault == "delete":
            client.delete(key)
        elif fault == "garbage":  # a good header over a random payload: only the payload xxh3 tells
            value = client.get(key)
            client.set(key, value[:-BLOCK_BYTES] + os.urandom(BLOCK_BYTES))
        elif fault == "truncate":
            client.set(key, client.get(key)[:-100])


@pytest.mark.parametrize("fault", ["flushall", "delete", "garbage", "truncate"])
def test_a_lost_or_damaged_block_costs_a_recompute(redis_server, expected, fault, monkeypatch):
    # no health check notices a flush before the reads do: they meet the fault itself
    monkeypatch.setattr(connection, "HEALTH_S", 600.0)
    with remote_llm(redis_server.url) as llm:
        assert generate(llm) == expected
        before = settled_stats(llm)
        damage(redis_server, fault)
        llm.reset_prefix_cache()  # the engine still knows the blocks as stored: it reads them
        assert generate(llm) == expected
        after = settled_stats(llm)
    assert after["remote_errors"] > 0 and after["remote_hit_blocks"] == 0
    kind = "remote_misses" if fault in ("flushall", "delete") else "remote_corrupt"
    assert after[kind] == after["remote_errors"]
    # the tier is used again: what was recomputed is stored anew
    assert after["remote_stored_blocks"] > before["remote_stored_blocks"]
    assert after["remote_connected"]


def test_a_server_killed_mid_run_then_restarted_empty(redis_server, expected):
    # arrival order: under `ttft` the request whose blocks come back from the server may be
    # admitted only once they have landed, and they count as CPU hits, not remote ones
    fcfs = {"cost_model": LOAD_WINS, "scheduling_policy": "fcfs"}
    with remote_llm(redis_server.url, scheduler=fcfs) as llm:
        assert generate(llm) == expected
        before = settled_stats(llm)
        redis_server.kill()
        llm.reset_prefix_cache()
        assert generate(llm) == expected  # its reads fail: recomputed
        down = llm.stats()
        assert down["remote_errors"] > 0 and not down["remote_connected"]
        redis_server.start()  # empty, on the same port
        wait_until(lambda: llm.stats()["remote_connected"], what="the engine reconnected")
        assert generate(llm) == expected
        # spilling paused while writes failed (up to a few seconds by now): it resumes after the pause
        wait_until(lambda: settled_stats(llm)["remote_stored_blocks"] > before["remote_stored_blocks"],
                   what="writes stored again")
        hits = llm.stats()["remote_hit_blocks"]
        llm.reset_prefix_cache()
        assert generate(llm) == expected  # prefixes from the restarted server
        after = llm.stats()
    assert after["remote_hit_blocks"] > hits and after["remote_errors"] == down["remote_errors"]


def test_an_unreachable_server_at_start_is_used_once_it_comes_up(tmp_path, expected, caplog):
    server = RedisServer(tmp_path / "redis")  # not started: nothing listens on its port
    try:
        with remote_llm(server.url) as llm:
            assert generate(llm) == expected
            assert not llm.stats()["remote_connected"] and llm.stats()["remote_stored_blocks"] == 0
            server.start()
            wait_until(lambda: llm.stats()["remote_connected"], what="the engine connected")
            llm.reset_prefix_cache()
            assert generate(llm) == expected
            assert settled_stats(llm)["remote_stored_blocks"] > 0
    finally:
        server.stop()
    said = [r for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(said) == 1 and server.url in said[0].getMessage()


def test_remote_bytes_bounds_what_the_engine_stores(redis_server, expected):
    with remote_llm(redis_server.url, remote_bytes=10 * 6144) as llm:  # 10 values of 4 KiB header + 2 KiB
        assert generate(llm) == expected
        stats = settled_stats(llm)
    assert stats["remote_evicted_blocks"] > 0 and stats["remote_owned_blocks"] == 10
    wait_until(lambda: len(redis_server.block_keys()) == 10, what="the server holds 10 blocks")


@pytest.mark.parametrize(
    "cache, message",
    [({"remote_url": "http://127.0.0.1:6379"}, "remote_url: 'http://127.0.0.1:6379' is not a Redis URL"),
     ({"remote_url": "redis://127.0.0.1:99999/0"}, "bad port"),
     ({"remote_url": "redis://:6379/0"}, "names no host"),
     ({"remote_url": "redis://127.0.0.1:6379/zero"}, "the database in"),
     ({"remote_url": ""}, "remote_url: expected a Redis URL"),
     ({"remote_url": []}, "remote_url: an empty list names no server"),
     ({"remote_url": ["redis://a:1/0", "redis://a:1/0"]}, "remote_url: 'redis://a:1/0' is listed twice"),
     ({"remote_url": ["redis://a:1/0", "http://b"]}, "remote_url: 'http://b' is not a Redis URL"),
     ({"remote_bytes": "1GiB"}, "remote_bytes: set remote_url"),
     ({"remote_url": "redis://127.0.0.1/0", "remote_bytes": "lots"}, "remote_bytes: cannot read 'lots'"),
     ({"remote_url": "redis://127.0.0.1/0", "cpu_cache_bytes": 0}, "remote_url: the remote tier sits below")],
)
def test_remote_config_errors_name_the_key(cache, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineConfig.from_kwargs(cache={"cpu_cache_bytes": "1MiB", **cache})


def test_remote_settings_the_client_refuses_name_the_key(redis_server):
    with pytest.raises(ValueError, match="remote_bytes: 100 bytes hold no KV block"):
        remote_llm(redis_server.url, remote_bytes=100)
    with pytest.raises(ValueError, match="remote_url: .*socket_timeout"):
        remote_llm(redis_server.url + "?socket_timeout=soon")


def test_loads_are_planned_against_the_servers_measured_bandwidth(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # calibrated here, not cached elsewhere
    with remote_llm(redis_server.url, scheduler={}) as llm:  # no cost model pinned
        cost = llm.scheduler.policy.cost
        assert llm.stats()["remote_errors"] == 0
    # measured through the store: at least a block per second, and no faster than memory
    assert BLOCK_BYTES < cost.disk_read_bytes_per_s < 1e12
    assert redis_server.block_keys() == []  # the probe block is gone
