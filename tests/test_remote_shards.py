"""The remote tier over two real redis-servers: every block on exactly one of them (the same one
whatever the order they are listed in), read back exact; an engine that loses one server
mid-run recomputes that server's share, counts it, and never gives a wrong token; and a
remote tier slower than recomputing is not waited for."""

from __future__ import annotations

import pytest
import torch

from tests.redis_server import wait_until
from tests.reference import settle_writes
from tests.remote_link import SlowLink
from tests.remote_worker import GREEDY, LOAD_WINS, NEW_TOKENS, prompts, remote_llm
from tests.test_remote_store import BLOCK_BYTES, BLOCK_SIZE, FINGERPRINT, block, ref
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.tiers.remote import open_remote
from tieredkv.tiers.remote.shards import RemoteShards
from tieredkv.tiers.remote.value_format import block_key


@pytest.fixture
def expected(reference_outputs):
    return reference_outputs("tiny-llama", prompts(), NEW_TOKENS)


def test_every_block_lands_on_one_server_and_reads_back_exact(two_servers):
    urls = tuple(s.url for s in two_servers)
    n = 64
    with open_remote(urls, 0, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE) as shards:
        assert isinstance(shards, RemoteShards)
        jobs = [shards.submit_write(ref(i), block(i)) for i in range(n)]
        assert all(shards.wait(jobs, timeout=30).values())
        placed = [shards.server_of(ref(i).block_hash) for i in range(n)]
    clients = [s.client() for s in two_servers]
    for i in range(n):
        key = block_key(FINGERPRINT, ref(i).block_hash)
        assert [bool(c.exists(key)) for c in clients] == [placed[i] == 0, placed[i] == 1]
    assert 16 < placed.count(0) < 48  # both servers hold a share
    # another engine listing them the other way round finds every block where it lies
    with open_remote(urls[::-1], 0, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE) as other:
        dst = torch.zeros((n, BLOCK_BYTES), dtype=torch.uint8)
        jobs = [other.submit_read(ref(i), dst[i]) for i in range(n)]
        assert None not in jobs and all(other.wait(jobs, timeout=30).values())
        stats = other.stats()
    assert all(torch.equal(dst[i], block(i)) for i in range(n))
    assert stats["remote_hit_blocks"] == n and stats["remote_errors"] == 0 and stats["remote_servers_up"] == 2


def test_the_same_server_listed_twice_is_refused(two_servers):
    url = two_servers[0].url
    with pytest.raises(ValueError, match="remote_url: the server 127.0.0.1:.*/0 is listed twice"):
        open_remote((url, url.removesuffix("/0")), 0, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE)


def generate(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def test_one_server_killed_mid_run_costs_recomputes_and_no_wrong_token(two_servers, expected):
    urls = [s.url for s in two_servers]
    fcfs = {"cost_model": LOAD_WINS, "scheduling_policy": "fcfs"}
    for server in two_servers:  # the blocks they hold are this engine's (not an earlier test's)
        server.client().flushall()
    with remote_llm(urls, scheduler=fcfs) as llm:
        # under load the first contact can outlast the start's wait: both links up before it runs
        wait_until(lambda: llm.stats()["remote_servers_up"] == 2, what="both servers reachable")
        assert generate(llm) == expected
        settle_writes(llm)  # idle steps: the spill-ahead writes go out
        assert all(s.block_keys() for s in two_servers), "both servers hold blocks"
        # blocks go to servers by hashing (their ports change from run to run), and a prefix is
        # read from its first block on: kill the server that does not hold a stored prompt's first
        # block, so that prefix still comes back from the other
        shards = llm.kv.offload.lower.store.remote
        assert isinstance(shards, RemoteShards)
        stored = {key.decode() for server in two_servers for key in server.block_keys()}
        heads = [extend_block_hashes([], p, llm.kv.block_size, llm.kv.root_hash)[:1] for p in prompts()]
        head = next(h for [h] in filter(None, heads) if block_key(llm.fingerprint, h) in stored)
        two_servers[1 - shards.server_of(head)].kill()
        llm.reset_prefix_cache()  # what the engine knows is on the servers, it reads from them
        assert generate(llm) == expected
        stats = llm.stats()
    assert stats["remote_errors"] > 0, stats  # the killed server's share: each read failed, recomputed
    assert stats["remote_hit_blocks"] > 0  # the other server's share came back
    assert stats["remote_servers_up"] == 1 and not stats["remote_connected"]


def test_a_remote_tier_slower_than_recomputing_is_not_waited_for(redis_server, expected, tmp_path, monkeypatch):
    """Blocks on a server behind a 100 KB/s link: the start-up probe measures it, and the
    plan recomputes the prefixes rather than wait for them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # calibrated here, not cached elsewhere
    with remote_llm(redis_server.url) as llm:  # fills the server
        assert generate(llm) == expected
    with SlowLink(redis_server.port, bytes_per_s=100_000) as link, remote_llm(link.url, scheduler={}) as llm:
        assert llm.scheduler.policy.cost.disk_read_bytes_per_s < 300_000  # measured through the link
        assert generate(llm) == expected
        stats, planned = llm.stats(), dict(llm.scheduler.loads.lower_prefix_blocks)
    assert planned["compute"] > 0 and planned["load"] == 0
    assert stats["remote_hit_blocks"] == 0
