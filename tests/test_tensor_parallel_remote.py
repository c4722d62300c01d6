"""The remote tier at two ranks (gloo, a real redis-server): each rank stores its share of a
block under a key of its own (`:r<rank>of2`); a second engine serves the prefixes from the
server with transformers' tokens (those of one rank); a block whose share is missing or corrupt
on one rank is a miss on both (recomputed), whether the lookup or the read finds it out."""

from __future__ import annotations

import pytest
import torch

from tests.remote_worker import GREEDY, NEW_TOKENS, prompts, remote_llm
from tests.test_remote_tier import settled_stats
from tieredkv import LLM
from tieredkv.parallel.sharded_remote import rank_key_suffix


def tp_remote_llm(url: str, device: str = "cpu") -> LLM:
    """Two ranks; GPU and CPU tiers so small that most prefixes end up on the server."""
    return remote_llm(url, device=device, dtype="float32", tensor_parallel_size=2)


TWO_GPUS = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")])


def generate(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def shares(server, rank: int) -> list[bytes]:
    """The keys of rank `rank`'s shares of the blocks on the server (a SCAN for its suffix)."""
    return sorted(server.client().scan_iter(match=f"tieredkv:*{rank_key_suffix(rank, 2)}", count=1000))


@pytest.fixture
def expected(reference_outputs):
    return reference_outputs("tiny-llama", prompts(), NEW_TOKENS)


@pytest.mark.parametrize("device", ["cpu", TWO_GPUS])
def test_two_ranks_store_their_shares_and_a_second_engine_reads_them(redis_server, expected, device):
    with tp_remote_llm(redis_server.url, device) as llm:
        assert generate(llm) == expected
        fingerprint = llm.fingerprint
    stats = llm.stats()  # closed: every write done
    assert stats["remote_stored_blocks"] > 0 and stats["remote_errors"] == 0
    rank0, rank1 = shares(redis_server, 0), shares(redis_server, 1)
    assert len(rank0) == len(rank1) == stats["remote_stored_blocks"]
    assert sorted(redis_server.block_keys()) == sorted(rank0 + rank1)  # no key without a rank
    blocks = {key.removesuffix(b":r0of2") for key in rank0}
    assert blocks == {key.removesuffix(b":r1of2") for key in rank1}  # both shares of every block
    assert all(key.startswith(f"tieredkv:{fingerprint:016x}:".encode()) for key in blocks)
    value = redis_server.client().get(rank0[0])
    assert len(value) - 2048 // 2 == len(redis_server.client().get(rank1[0])) - 2048 // 2 > 0  # half a block each

    with tp_remote_llm(redis_server.url, device) as llm:
        assert generate(llm) == expected
        stats = llm.stats()
    assert stats["remote_hit_blocks"] > 0 and stats["remote_errors"] == 0
    assert stats["nvme_loaded_blocks"] == stats["remote_hit_blocks"] and stats["nvme_failed_loads"] == 0


def test_a_share_missing_or_corrupt_on_one_rank_is_a_miss_on_both(redis_server, expected):
    with tp_remote_llm(redis_server.url) as llm:
        assert generate(llm) == expected
        before = settled_stats(llm)
        assert before["remote_stored_blocks"] > 0
        client = redis_server.client()
        rank1 = shares(redis_server, 1)
        client.unlink(*rank1[1::2])  # rank 1 loses every other share
        for key in rank1[::2]:  # and the value of the others is garbage
            client.setrange(key, len(client.get(key)) - 8, b"garbage!")
        llm.reset_prefix_cache()
        # this engine stored them: it reads without asking, rank 0 finds its shares, rank 1 not
        assert generate(llm) == expected
        after = settled_stats(llm)
    assert after["remote_hit_blocks"] == before["remote_hit_blocks"]  # not one block read
    failed = after["nvme_failed_loads"] - before["nvme_failed_loads"]
    assert failed > 0 and after["nvme_loaded_blocks"] == before["nvme_loaded_blocks"]
    assert after["remote_misses"] + after["remote_corrupt"] == failed
    assert after["remote_misses"] > 0 and after["remote_corrupt"] > 0

    # a new engine, rank 1's shares all gone: its lookups miss, so no read starts on either rank
    client.unlink(*shares(redis_server, 1))
    assert shares(redis_server, 0) and not shares(redis_server, 1)
    with tp_remote_llm(redis_server.url) as llm:
        assert generate(llm) == expected
        stats = llm.stats()
    assert stats["remote_hit_blocks"] == stats["nvme_loaded_blocks"] == stats["nvme_failed_loads"] == 0
    assert stats["remote_errors"] == 0 and shares(redis_server, 1)  # rank 1's shares written anew
