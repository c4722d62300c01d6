"""The remote store against a real redis-server: blocks come back bit-identical and verified, a
damaged or foreign value is never served, the budget holds, requests in flight stay bounded, and
every fault (server killed, hung, flushed) fails jobs without raising and heals when it ends."""

from __future__ import annotations

import pytest
import torch

from tests.redis_server import wait_until
from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.remote import StorePair
from tieredkv.tiers.remote.store import RemoteStore
from tieredkv.tiers.remote.value_format import block_key

BLOCK_BYTES = 3000  # not a multiple of 4 KiB or of the header
BLOCK_SIZE = 4
FINGERPRINT = 0x1234_5678_9ABC_DEF0


def ref(i: int) -> BlockRef:
    return BlockRef(1000 + i, 999 + i, (i, i + 1, i + 2, i + 3))


def block(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def open_store(url: str, **kw) -> RemoteStore:
    return RemoteStore(url, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE, **kw)


def write_all(store: RemoteStore, ids) -> dict[int, bool]:
    jobs = [store.submit_write(ref(i), block(i)) for i in ids]
    assert None not in jobs
    return store.wait(jobs, timeout=30)


def read(store: RemoteStore, i: int, r: BlockRef | None = None) -> tuple[bool | None, torch.Tensor]:
    dst = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    job = store.submit_read(r or ref(i), dst)
    return (None if job is None else store.wait([job], timeout=30)[job]), dst


def test_blocks_come_back_bit_identical_and_are_shared(redis_server):
    with open_store(redis_server.url) as a, open_store(redis_server.url) as b:
        assert all(write_all(a, range(20)).values())
        assert a.stats()["remote_stored_blocks"] == 20
        for i in range(20):  # the other engine finds them through the server
            assert b.contains(ref(i).block_hash)
            ok, dst = read(b, i)
            assert ok and torch.equal(dst, block(i))
        assert not b.contains(ref(20).block_hash)
        assert read(b, 20)[0] is None
        # a block the server holds already is not sent again, and counts as stored
        assert b.submit_write(ref(3), block(3)) is None  # b knows it now: nothing to do
        with open_store(redis_server.url) as c:
            job = c.submit_write(ref(4), block(4))
            assert c.wait([job])[job]
            assert c.stats()["remote_write_skipped"] == 1 and c.stats()["remote_stored_blocks"] == 0
        stats = b.stats()
    assert stats["remote_hit_blocks"] == 20 and stats["remote_errors"] == 0
    assert stats["remote_bytes_read"] == 20 * BLOCK_BYTES


@pytest.mark.parametrize("wrong", ["parent", "tokens", "fingerprint"])
def test_a_value_for_another_block_or_model_is_never_served(redis_server, wrong):
    with open_store(redis_server.url) as store:
        write_all(store, [0])
        good = ref(0)
        if wrong == "parent":
            ok, _ = read(store, 0, good._replace(parent_hash=good.parent_hash + 1))
        elif wrong == "tokens":
            ok, _ = read(store, 0, good._replace(token_ids=(9, 9, 9, 9)))
        else:  # another model's value under this model's key
            client = redis_server.client()
            with RemoteStore(redis_server.url, BLOCK_BYTES, FINGERPRINT + 1, BLOCK_SIZE) as foreign:
                write_all(foreign, [0])
            value = client.get(block_key(FINGERPRINT + 1, good.block_hash))
            client.set(block_key(FINGERPRINT, good.block_hash), value)
            ok, _ = read(store, 0)
        assert ok is False
        assert store.stats()["remote_corrupt"] == 1 and store.stats()["remote_errors"] == 1


@pytest.mark.parametrize("damage", ["garbage", "truncated", "deleted", "flipped payload byte"])
def test_damaged_values_fail_reads_and_are_replaced(redis_server, damage):
    client = redis_server.client()
    with open_store(redis_server.url) as store:
        write_all(store, range(4))
        key = block_key(FINGERPRINT, ref(2).block_hash)
        value = client.get(key)
        if damage == "garbage":
            client.set(key, bytes(len(value)))
        elif damage == "truncated":
            client.set(key, value[: len(value) - 1])
        elif damage == "deleted":
            client.delete(key)
        else:
            client.setrange(key, len(value) - 10, bytes([value[-10] ^ 1]))
        ok, _ = read(store, 2)
        assert ok is False
        stats = store.stats()
        assert stats["remote_errors"] == 1
        assert stats["remote_misses" if damage == "deleted" else "remote_corrupt"] == 1
        assert not client.exists(key)  # a damaged value is deleted, so a later write replaces it
        assert not store.contains(ref(2).block_hash)
        assert all(write_all(store, [2]).values())
        ok, dst = read(store, 2)
        assert ok and torch.equal(dst, block(2))
        assert all(read(store, i)[0] for i in (0, 1, 3))  # the others were never touched


def test_the_budget_deletes_the_blocks_used_least_recently(redis_server):
    client = redis_server.client()
    with open_store(redis_server.url) as probe:
        value_bytes = probe.layout.value_bytes
    with open_store(redis_server.url, budget_bytes=3 * value_bytes + 100) as store:
        for i in range(3):  # one at a time: blocks written together are owned in the order they land
            write_all(store, [i])
        assert read(store, 0)[0]  # block 0 is now the most recently used
        write_all(store, [3])
        wait_until(lambda: not client.exists(block_key(FINGERPRINT, ref(1).block_hash)), what="block 1 deleted")
        write_all(store, [4])
        wait_until(lambda: not client.exists(block_key(FINGERPRINT, ref(2).block_hash)), what="block 2 deleted")
        assert [bool(client.exists(block_key(FINGERPRINT, ref(i).block_hash))) for i in range(5)] == [
            True, False, False, True, True]
        stats = store.stats()
    assert stats["remote_evicted_blocks"] == 2 and stats["remote_owned_blocks"] == 3


def test_requests_in_flight_are_bounded(redis_server):
    client = redis_server.client()
    before = client.info("clients")["connected_clients"]
    with open_store(redis_server.url, max_in_flight=2, pipeline_ops=4) as store:
        write_all(store, range(64))
        dsts = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(64)]
        jobs = [store.submit_read(ref(i), dsts[i]) for i in range(64)]
        peak = client.info("clients")["connected_clients"] - before
        assert all(store.wait(jobs, timeout=30).values())
        assert all(torch.equal(dsts[i], block(i)) for i in range(64))
        peak = max(peak, client.info("clients")["connected_clients"] - before)
    assert 1 <= peak <= 2 + 2  # two pipelines in flight, and the lookups' and health checks' room


def test_a_server_killed_and_restarted_empty(redis_server, caplog):
    with open_store(redis_server.url) as store:
        write_all(store, range(4))
        redis_server.kill()
        ok, _ = read(store, 0)  # known stored: the read is sent, and fails
        assert ok is False
        assert not store.stats()["remote_connected"]
        assert store.submit_write(ref(9), block(9)) is None and read(store, 1)[0] is None  # down: no tries
        errors = store.stats()["remote_errors"]
        redis_server.start()  # empty, same port
        wait_until(lambda: store.stats()["remote_connected"], what="the store reconnected")
        assert not store.contains(ref(0).block_hash)  # a new epoch: what it knew is forgotten
        assert all(write_all(store, [0]).values())
        ok, dst = read(store, 0)
        assert ok and torch.equal(dst, block(0))
        assert store.stats()["remote_errors"] == errors
    lost = [r for r in caplog.records if "lost the server" in r.getMessage()]
    back = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(lost) == 1 and len(back) == 1


def test_a_flushed_server_is_noticed_by_its_epoch(redis_server):
    with open_store(redis_server.url) as store:
        write_all(store, range(4))
        assert store.contains(ref(0).block_hash)
        redis_server.client().flushall()
        wait_until(lambda: not store.contains(ref(0).block_hash), what="the flush noticed")
        assert store.stats()["remote_errors"] == 0
        assert all(write_all(store, range(4)).values())
        assert all(read(store, i)[0] for i in range(4))


def test_an_epoch_key_of_another_type_is_replaced_by_a_new_epoch(redis_server):
    with open_store(redis_server.url) as store:
        write_all(store, range(2))
        client = redis_server.client()
        key = next(k for k in client.scan_iter(match="tieredkv:*") if k.endswith(b":epoch"))
        client.delete(key)
        client.rpush(key, b"not an epoch")
        wait_until(lambda: client.type(key) == b"string", what="a new epoch named")
        wait_until(lambda: store.stats()["remote_connected"], what="the tier up")
        assert all(write_all(store, range(2)).values())
        assert all(read(store, i)[0] for i in range(2))


def test_a_hung_server_times_out_and_comes_back(redis_server):
    with open_store(redis_server.url + "?socket_timeout=0.5") as store:
        write_all(store, range(2))
        redis_server.pause()
        try:
            ok, _ = read(store, 0)  # answered by the socket timeout, not by the server
            assert ok is False and not store.stats()["remote_connected"]
        finally:
            redis_server.resume()
        wait_until(lambda: store.stats()["remote_connected"], what="the store reconnected")
        assert all(read(store, i)[0] for i in range(2))  # same server, same epoch: still known


def test_unreachable_at_start_is_no_error(tmp_path, caplog):
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis")  # not started
    with open_store(server.url) as store:
        assert not store.stats()["remote_connected"]
        assert not store.contains(ref(0).block_hash) and store.submit_write(ref(0), block(0)) is None
        server.start()
        try:
            wait_until(lambda: store.stats()["remote_connected"], what="the store connected")
            assert all(write_all(store, [0]).values())
        finally:
            server.stop()
    said = [r for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(said) == 1


def test_store_pair_reads_the_first_store_that_holds_a_block(redis_server, tmp_path):
    from tieredkv.tiers.nvme import NVMeStore

    nvme = NVMeStore(tmp_path / "nvme", 1 << 20, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE, backend="sync")
    remote = open_store(redis_server.url)
    with open_store(redis_server.url) as other:  # another engine stored block 7 on the server only
        write_all(other, [7])
    pair = StorePair(nvme, remote)
    try:
        jobs = [pair.submit_write(ref(i), block(i)) for i in range(3)]
        assert pair.wait(jobs, timeout=30) == dict.fromkeys(jobs, True)
        assert all(nvme.contains(ref(i).block_hash) and remote.contains(ref(i).block_hash) for i in range(3))
        assert pair.contains(ref(7).block_hash) and not nvme.contains(ref(7).block_hash)
        dsts = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(2)]
        reads = [pair.submit_read(ref(1), dsts[0]), pair.submit_read(ref(7), dsts[1])]
        done: list[tuple[int, bool]] = []
        wait_until(lambda: done.extend(pair.poll()) or len(done) == 2, what="both reads reported by poll")
        assert sorted(done) == sorted((job, True) for job in reads)
        assert torch.equal(dsts[0], block(1)) and torch.equal(dsts[1], block(7))
        assert nvme.stats()["hits"] == 1 and remote.stats()["remote_hit_blocks"] == 1
        assert pair.submit_read(ref(8), dsts[0]) is None
    finally:
        pair.close()
