"""The spill writes a CPU block to the store below once, and again once the store has lost it:
its file deleted and made anew, its Redis server flushed or restarted empty. A block the store's
policy or budget evicted is its choice: not written again at once (each write would evict
another). A write that failed is not taken for a stored block.

Real stores: an NVMe store on a temporary directory, a redis-server on a free loopback port. The
CPU tier is a pool of 16 blocks, 12 of them cached and nobody's: spill-ahead writes the coldest
8 (its window), all at once."""

from __future__ import annotations

import os
import time

import pytest

from tests.redis_server import wait_until
from tests.test_nvme_store import BLOCK_BYTES, BLOCK_SIZE, FP, cpu_pool, slots_capacity
from tests.test_slow_tier import ref
from tieredkv.cache import spill as spill_module
from tieredkv.cache.block_pool import BlockPool
from tieredkv.cache.spill import Spill
from tieredkv.tiers.backend import MAX_LOST_LISTED, BlockStore, LossLog, LostBlocks
from tieredkv.tiers.nvme.file_keeper import LOOK_EVERY_S
from tieredkv.tiers.nvme.io_backends import FaultyBackend, SyncBackend
from tieredkv.tiers.nvme.store import NVMeStore
from tieredkv.tiers.remote.store import RemoteStore
from tieredkv.tiers.remote.value_format import ValueLayout, block_key

WINDOW = [1000 + i for i in range(8)]  # the coldest cached CPU blocks: those spill-ahead writes
DEMOTED = [2000, 2001]  # blocks demoted through a staging block, not cached in the CPU tier
REMOTE_FP = 0x5EED


def cpu_tier() -> BlockPool:
    """16 CPU blocks: 12 cached, nobody's, 1000 the coldest; one becomes the spill's staging block."""
    pool = BlockPool(16)
    blocks = pool.allocate(12)
    for i, block in enumerate(blocks):
        pool.cache(block, *ref(1000 + i))
    pool.release(blocks)
    return pool


def settle(spill: Spill) -> None:
    """Book the spill's writes until none is in flight (they finish on the store's threads)."""
    deadline = time.monotonic() + 30
    while spill.writes_in_flight:
        assert time.monotonic() < deadline, "the store's writes did not finish"
        spill.poll()
        time.sleep(0.005)


def step(spill: Spill) -> None:
    """A step's spill work, as `LowerTier.retire` does it: book what the store finished and
    lost, then spill ahead; then let the writes finish."""
    spill.poll()
    spill.spill_ahead(reads_in_flight=0)
    settle(spill)


def stored(store: BlockStore, hashes: list[int]) -> list[int]:
    return [h for h in hashes if store.contains(h)]


def nvme_store(tmp_path, num_slots: int = 16, backend: str | FaultyBackend = "sync") -> NVMeStore:
    return NVMeStore(tmp_path / "kv", slots_capacity(num_slots), BLOCK_BYTES, FP, BLOCK_SIZE, backend=backend,
                     policy="lru")


def server_keys(redis_server) -> set[bytes]:
    return set(redis_server.block_keys())


def keys_of(hashes: list[int]) -> set[bytes]:
    return {block_key(REMOTE_FP, h).encode() for h in hashes}


# ------------------------------------------------------------------ the whole store lost


@pytest.mark.parametrize("noticed_by", ["a request's read", "the spill"])
def test_blocks_lost_with_the_store_file_are_written_again(tmp_path, noticed_by, monkeypatch):
    # while one write makes the new file, the store starts no other (it refuses them): those are
    # offered again at the next step, not after REFUSED_RETRY_S
    monkeypatch.setattr(spill_module, "REFUSED_RETRY_S", 0.0)
    with nvme_store(tmp_path) as store:
        spill = Spill(store, cpu_tier(), cpu_pool(16))
        step(spill)
        assert stored(store, WINDOW) == WINDOW
        os.unlink(store.path)
        time.sleep(2 * LOOK_EVERY_S)  # the store looks at its file at most this often
        if noticed_by == "a request's read":
            assert store.submit_read(ref(1000), cpu_pool(1)[0]) is None  # the file is gone: a miss
            assert stored(store, WINDOW) == []
        for _ in range(2):
            step(spill)
        assert store.stats()["files_lost"] == 1
        assert stored(store, WINDOW) == WINDOW and os.path.exists(store.path)  # in the new file
        assert store.stats()["writes"] == 16  # each block of the window once more


@pytest.mark.parametrize("loss", ["flushed", "restarted empty"])
def test_blocks_a_redis_server_lost_are_written_again(redis_server, loss):
    with RemoteStore(redis_server.url, BLOCK_BYTES, REMOTE_FP, BLOCK_SIZE) as store:
        spill = Spill(store, cpu_tier(), cpu_pool(16))
        step(spill)
        assert server_keys(redis_server) == keys_of(WINDOW)
        if loss == "flushed":
            redis_server.client().flushall()
        else:
            redis_server.kill()
            redis_server.start()  # empty, on the same port
        wait_until(lambda: store.link.up and not store.contains(WINDOW[0]), what="the new epoch noticed")
        step(spill)
        assert server_keys(redis_server) == keys_of(WINDOW)


# ------------------------------------------------------------------ one block lost


def evict_the_coldest(spill: Spill, store: BlockStore) -> None:
    """Fill a store with room for 9 blocks so that it drops WINDOW[0]: spill-ahead writes the
    window, a demotion DEMOTED[0], requests read WINDOW[1:] back (they are used), then the
    demotion DEMOTED[1] takes the place of the least recently used block, WINDOW[0]."""
    step(spill)
    for i, block_hash in enumerate(DEMOTED):
        if i:
            dsts = cpu_pool(len(WINDOW) - 1)
            jobs = [store.submit_read(ref(h), dst) for h, dst in zip(WINDOW[1:], dsts, strict=True)]
            assert all(store.wait(jobs, 30).values())
        staging = spill.stage(reads_in_flight=0)
        spill.write_staged(staging, ref(block_hash), reads_in_flight=0)
        settle(spill)


def test_a_block_the_nvme_store_evicted_is_not_written_again(tmp_path):
    with nvme_store(tmp_path, num_slots=9) as store:
        spill = Spill(store, cpu_tier(), cpu_pool(16))
        evict_the_coldest(spill, store)
        assert stored(store, WINDOW + DEMOTED) == WINDOW[1:] + DEMOTED and store.stats()["evictions"] == 1
        writes = store.stats()["writes"]
        for _ in range(3):
            step(spill)
        assert stored(store, WINDOW + DEMOTED) == WINDOW[1:] + DEMOTED and store.stats()["writes"] == writes


def test_a_block_the_redis_budget_deleted_is_not_written_again(redis_server):
    value_bytes = ValueLayout.for_block(BLOCK_BYTES, BLOCK_SIZE, REMOTE_FP).value_bytes
    with RemoteStore(redis_server.url, BLOCK_BYTES, REMOTE_FP, BLOCK_SIZE, budget_bytes=9 * value_bytes) as store:
        spill = Spill(store, cpu_tier(), cpu_pool(16))
        evict_the_coldest(spill, store)
        wait_until(lambda: server_keys(redis_server) == keys_of(WINDOW[1:] + DEMOTED), what="WINDOW[0] deleted")
        written = spill.spilled_blocks
        for _ in range(3):
            step(spill)
        assert spill.spilled_blocks == written and server_keys(redis_server) == keys_of(WINDOW[1:] + DEMOTED)


def test_a_failed_write_is_not_taken_for_a_stored_block(tmp_path):
    faulty = FaultyBackend(SyncBackend(2))
    faulty.inject("write", "error")  # the first write fails
    with nvme_store(tmp_path, backend=faulty) as store:
        spill = Spill(store, cpu_tier(), cpu_pool(16))
        step(spill)
        assert stored(store, WINDOW) == WINDOW[1:] and store.stats()["io_errors"] == 1
        step(spill)
        assert stored(store, WINDOW) == WINDOW and store.stats()["writes"] == 8  # WINDOW[0] once more


def test_a_block_a_read_found_damaged_is_written_again(tmp_path):
    faulty = FaultyBackend(SyncBackend(2))
    with nvme_store(tmp_path, backend=faulty) as store:
        spill = Spill(store, cpu_tier(), cpu_pool(16))
        step(spill)
        assert stored(store, WINDOW) == WINDOW
        faulty.inject("read", "error")  # a request's read of WINDOW[0] fails: the store discards it
        job = store.submit_read(ref(WINDOW[0]), cpu_pool(1)[0])
        assert store.wait([job], 30) == {job: False}
        assert stored(store, WINDOW) == WINDOW[1:]
        step(spill)
        assert stored(store, WINDOW) == WINDOW and store.stats()["writes"] == 9  # WINDOW[0] once more


def test_a_loss_log_past_its_listing_says_all_were_lost_and_losses_merge():
    log = LossLog()
    for block_hash in range(MAX_LOST_LISTED):
        log.lose(block_hash)
    assert log.take() == LostBlocks(block_hashes=frozenset(range(MAX_LOST_LISTED)))
    assert log.take() == LostBlocks()  # taken: nothing since
    for block_hash in range(MAX_LOST_LISTED + 1):
        log.lose(block_hash)
    assert log.take() == LostBlocks(everything=True)
    some, other = LostBlocks(block_hashes=frozenset({1, 2})), LostBlocks(block_hashes=frozenset({3}))
    assert LostBlocks.merge([some, other]) == LostBlocks(block_hashes=frozenset({1, 2, 3}))
    assert LostBlocks.merge([some, LostBlocks(everything=True)]) == LostBlocks(everything=True)
