"""Faults of the tiers below the CPU tier while the engine serves: each costs a recompute, never a
wrong token, a lost request or a hang; it is said once (not per block) and counted, and the tier is
used again once it can be.

The engine runs tiny-llama with GPU and CPU tiers too small for the prompts, so blocks go down to
the store (a real file) or the server (a real redis-server) and come back; tokens are compared with
transformers' greedy ones."""

from __future__ import annotations

import logging
import os
import shutil
import time

import pytest

from tests.redis_server import wait_until
from tests.reference import make_prompts, settle_writes
from tests.remote_worker import LOAD_WINS, remote_llm
from tests.test_remote_tier import generate, settled_stats
from tests.test_tier_hardening import NEW_TOKENS, short_back_offs, tiny_llm, tokens
from tieredkv.tiers.nvme import STORE_FILE_NAME

FCFS = {"cost_model": LOAD_WINS, "scheduling_policy": "fcfs"}  # loads counted as remote hits (see test_remote_tier)


def warnings_saying(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


@pytest.fixture
def expected(reference_outputs):
    return reference_outputs("tiny-llama", make_prompts(vocab_size=512), NEW_TOKENS)


# ------------------------------------------------------------------ NVMe


def overwrite_slots(store, damage: str) -> None:
    """Spoil every slot of the store's file in place: random bytes, or each slot holding the next
    one's valid header and payload (an index that no longer matches the file)."""
    g = store.geometry
    with open(store.path, "r+b") as f:
        slots = []
        for slot in range(g.num_slots):
            f.seek(g.slot_offset(slot))
            slots.append(f.read(g.slot_bytes))
        for slot in range(g.num_slots):
            f.seek(g.slot_offset(slot))
            f.write(os.urandom(g.slot_bytes) if damage == "garbage" else slots[(slot + 1) % g.num_slots])


@pytest.mark.parametrize("damage", ["garbage", "another block's slot"])
def test_slots_spoiled_mid_run_cost_a_recompute_said_once(tmp_path, expected, damage, caplog):
    prompts = make_prompts(vocab_size=512)
    with tiny_llm(tmp_path, 16) as llm, caplog.at_level(logging.INFO, logger="tieredkv"):
        assert tokens(llm, prompts) == expected
        settle_writes(llm)
        overwrite_slots(llm.kv.offload.lower.store, damage)
        llm.reset_prefix_cache()  # the engine reads back what it wrote
        assert tokens(llm, prompts) == expected
        stats = llm.stats()
    assert stats["nvme_corrupt"] > 0 and stats["nvme_failed_loads"] == stats["nvme_corrupt"]
    assert stats["nvme_loaded_blocks"] == stats["nvme_hits"]
    assert len(warnings_saying(caplog, "corrupt")) == 1


def test_a_store_directory_deleted_mid_run_is_made_again(tmp_path, expected, monkeypatch):
    short_back_offs(monkeypatch)
    prompts = make_prompts(vocab_size=512)
    folder = tmp_path / "kv"
    with tiny_llm(folder, 16) as llm:
        assert tokens(llm, prompts) == expected
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
        shutil.rmtree(folder)
        deadline, seed = time.monotonic() + 10, 1
        while not (folder / STORE_FILE_NAME).exists() and time.monotonic() < deadline:
            tokens(llm, make_prompts(vocab_size=512, seed=seed))  # new blocks to write
            seed += 1
        assert (folder / STORE_FILE_NAME).exists()
        stats = settle_writes(llm)
        assert stats["nvme_files_lost"] == 1 and stats["nvme_slots_used"] > 0
        llm.reset_prefix_cache()
        assert tokens(llm, prompts) == expected


# ------------------------------------------------------------------ Redis


def test_a_server_restarted_with_its_blocks_serves_them_at_once(redis_server, expected, caplog):
    with remote_llm(redis_server.url, scheduler=FCFS) as llm, caplog.at_level(logging.INFO, logger="tieredkv"):
        assert generate(llm) == expected
        settled_stats(llm)
        llm.reset_prefix_cache()
        assert generate(llm) == expected  # reads: the reader threads hold connections now
        assert llm.stats()["remote_hit_blocks"] > 0
        redis_server.client().save()
        redis_server.kill()
        wait_until(lambda: not llm.stats()["remote_connected"], what="the engine saw the server go")
        redis_server.start()  # loads what it saved: the same blocks, the same epoch
        wait_until(lambda: llm.stats()["remote_connected"], what="the engine reconnected")
        before = llm.stats()
        llm.reset_prefix_cache()
        assert generate(llm) == expected
        after = llm.stats()
    assert after["remote_hit_blocks"] > before["remote_hit_blocks"]
    assert after["remote_errors"] == before["remote_errors"]
    assert after["nvme_failed_loads"] == before["nvme_failed_loads"] == 0
    assert len(warnings_saying(caplog, "lost the server")) == 1


def swap_values(server) -> int:
    """Give each stored block the value of another (each value valid for its own block)."""
    client, keys = server.client(), server.block_keys()
    values = [client.get(key) for key in keys]
    for key, value in zip(keys, values[1:] + values[:1], strict=True):
        client.set(key, value)
    return len(keys)


def test_values_swapped_between_blocks_cost_a_recompute_said_once(redis_server, expected, caplog):
    with remote_llm(redis_server.url, scheduler=FCFS) as llm, caplog.at_level(logging.INFO, logger="tieredkv"):
        assert generate(llm) == expected
        settled_stats(llm)
        assert swap_values(redis_server) > 1
        llm.reset_prefix_cache()
        assert generate(llm) == expected
        stats = settled_stats(llm)
    assert stats["remote_corrupt"] > 0 and stats["remote_hit_blocks"] == 0
    assert len(warnings_saying(caplog, "did not verify")) == 1


def test_writes_refused_by_a_full_server_are_said_once(redis_server, expected, caplog):
    client = redis_server.client()
    with remote_llm(redis_server.url) as llm, caplog.at_level(logging.INFO, logger="tieredkv"):
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1")  # every write is refused (out of memory)
        assert generate(llm) == expected
        stats = settled_stats(llm)
        assert stats["remote_stored_blocks"] == 0 and stats["remote_errors"] > 1 and stats["remote_connected"]
        client.config_set("maxmemory", "0")
        llm.reset_prefix_cache()
        assert generate(llm) == expected
        wait_until(lambda: settled_stats(llm)["remote_stored_blocks"] > 0, what="writes stored again")
    assert len(warnings_saying(caplog, "refused")) == 1


def test_a_paused_server_costs_a_timeout_not_a_hang(redis_server, expected):
    url = redis_server.url + "?socket_timeout=1"
    with remote_llm(url, scheduler=FCFS) as llm:
        assert generate(llm) == expected
        settled_stats(llm)
        llm.reset_prefix_cache()
        redis_server.pause()
        try:
            start = time.monotonic()
            assert generate(llm) == expected  # its loads wait for the server, then fail: recomputed
            took = time.monotonic() - start
            stats = llm.stats()
        finally:
            redis_server.resume()
        assert stats["nvme_failed_loads"] > 0 and not stats["remote_connected"]
        assert took < 20  # a read times out after 1 s, a lookup after 2 s
        wait_until(lambda: llm.stats()["remote_connected"], what="the engine reconnected")
        llm.reset_prefix_cache()
        assert generate(llm) == expected
        assert llm.stats()["remote_hit_blocks"] > 0
