"""NVMe block store: exact round trips, restarts, LRU order, every fault, a SIGKILLed writer."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Sequence

import pytest
import torch

from tieredkv.tiers.backend import BlockRef, BlockStore
from tieredkv.tiers.nvme import io_backends, slot_file, slot_format
from tieredkv.tiers.nvme.block_io import BlockIO, IOCompletion, IORequest
from tieredkv.tiers.nvme.file_keeper import LOOK_EVERY_S
from tieredkv.tiers.nvme.io_backends import FaultyBackend, SyncBackend
from tieredkv.tiers.nvme.slot_format import SUPERBLOCK_BYTES, SlotGeometry, aligned_empty
from tieredkv.tiers.nvme.store import NVMeStore

BLOCK_SIZE = 16
KV_SHAPE = (2, 2, BLOCK_SIZE, 2, 64)  # layers, K/V, tokens, kv heads, head dim: 16 KiB of bf16
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 2
FP = b"tiny-llama|bfloat16|16"
BACKENDS = ["sync", "aiofiles", "uring"]


def tokens_of(h: int) -> list[int]:
    return [(h * 7919 + i) % 32000 for i in range(BLOCK_SIZE)]


def parent_of(h: int) -> int:
    return (h * 0x9E3779B97F4A7C15) % 2**64


def content_of(h: int, nbytes: int = BLOCK_BYTES) -> torch.Tensor:
    """Deterministic bytes of block `h` (the killed writer uses the same function)."""
    gen = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def cpu_pool(num_blocks: int, aligned: bool = True) -> torch.Tensor:
    """A block-major bf16 pool like the engine's CPU tier; `aligned=False` shifts it off 4 KiB."""
    raw = aligned_empty(num_blocks * BLOCK_BYTES + 64)
    raw = raw if aligned else raw[64:]
    return raw[: num_blocks * BLOCK_BYTES].view(torch.bfloat16).view(num_blocks, *KV_SHAPE)


def fill(pool: torch.Tensor, hashes: Sequence[int]) -> None:
    for i, h in enumerate(hashes):
        pool[i].view(-1).view(torch.uint8).copy_(content_of(h, pool[i].numel() * 2))


def block_bytes_of(block: torch.Tensor) -> torch.Tensor:
    return block.reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (torch.equal on random bf16 bits would trip over NaNs)."""
    return torch.equal(block_bytes_of(a), block_bytes_of(b))


def write_all(store: NVMeStore, pool: torch.Tensor, hashes: Sequence[int]) -> dict[int, bool]:
    jobs = [
        store.submit_write(BlockRef(h, parent_of(h), tokens_of(h)), pool[i]) for i, h in enumerate(hashes)
    ]
    assert None not in jobs
    return store.wait(jobs)


def read_one(store: NVMeStore, h: int, dst: torch.Tensor) -> bool | None:
    """True/False: the read's outcome; None: the store did not have the block."""
    job = store.submit_read(BlockRef(h, parent_of(h), tokens_of(h)), dst)
    return None if job is None else store.wait([job])[job]


def slots_capacity(num_slots: int, block_bytes: int = BLOCK_BYTES) -> int:
    g = SlotGeometry.for_block(1 << 40, block_bytes, BLOCK_SIZE)
    return SUPERBLOCK_BYTES + num_slots * g.slot_bytes


@pytest.fixture(params=BACKENDS)
def backend_name(request) -> str:
    if request.param == "uring" and not io_backends.uring_probe()[0]:
        pytest.skip(f"io_uring unusable here: {io_backends.uring_probe()[1]}")
    return request.param


@pytest.fixture
def open_store(tmp_path):
    """`open_store(**overrides)`: a store in tmp_path (sync backend, 8 slots), closed at the end."""
    stores = []

    def make(**kw) -> NVMeStore:
        args = dict(
            path=tmp_path / "kv",
            capacity_bytes=slots_capacity(8),
            block_bytes=BLOCK_BYTES,
            fingerprint=FP,
            block_size=BLOCK_SIZE,
            backend="sync",
        )
        args.update(kw)
        stores.append(NVMeStore(**args))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("aligned", [True, False], ids=["zero-copy", "bounce"])
def test_round_trip_is_bit_identical(open_store, backend_name, aligned):
    hashes = list(range(101, 113))
    store = open_store(backend=backend_name, capacity_bytes=slots_capacity(16), queue_depth=8)
    src, dst = cpu_pool(len(hashes), aligned), cpu_pool(len(hashes), aligned)
    fill(src, hashes)
    dst.zero_()
    assert write_all(store, src, hashes) == dict.fromkeys(range(1, 13), True)
    jobs = [store.submit_read(BlockRef(h, parent_of(h), tokens_of(h)), dst[i]) for i, h in enumerate(hashes)]
    assert all(store.wait(jobs).values())
    assert same_bytes(dst, src)
    stats = store.stats()
    assert (stats["writes"], stats["hits"], stats["slots_used"], stats["slots_free"]) == (
        12,
        12,
        12,
        4,
    )
    assert stats["backend"] == backend_name
    assert stats["bytes_written"] == stats["bytes_read"] == 12 * (4096 + BLOCK_BYTES)


def test_unaligned_burst_waits_for_a_bounded_set_of_bounce_buffers(open_store):
    hashes = list(range(1, 21))
    store = open_store(capacity_bytes=slots_capacity(20), queue_depth=2)
    src, dst = cpu_pool(20, aligned=False), cpu_pool(20, aligned=False)
    fill(src, hashes)
    assert all(write_all(store, src, hashes).values())
    jobs = [store.submit_read(BlockRef(h, parent_of(h), tokens_of(h)), dst[i]) for i, h in enumerate(hashes)]
    assert all(store.wait(jobs).values()) and same_bytes(dst, src)
    assert store._io._bounces._made == 2


def test_block_size_not_a_multiple_of_4k(open_store):
    nbytes = 10_000
    store = open_store(block_bytes=nbytes, capacity_bytes=slots_capacity(4, nbytes))
    src = torch.stack([content_of(h, nbytes) for h in (1, 2)])
    dst = torch.zeros_like(src)
    jobs = [store.submit_write(BlockRef(h, parent_of(h), tokens_of(h)), src[i]) for i, h in enumerate((1, 2))]
    assert all(store.wait(jobs).values())
    assert read_one(store, 1, dst[0]) and read_one(store, 2, dst[1])
    assert same_bytes(dst, src)


def test_buffered_fallback_where_o_direct_is_refused(open_store, monkeypatch, caplog):
    real_open = os.open

    def open_like_an_old_tmpfs(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(slot_file.os, "open", open_like_an_old_tmpfs)
    monkeypatch.setattr(slot_file, "_warned_dirs", set())
    with caplog.at_level(logging.WARNING):
        store = open_store()
    assert store.stats()["o_direct"] is False and "does not take O_DIRECT" in caplog.text
    src, dst = cpu_pool(1, aligned=False), cpu_pool(1, aligned=False)
    fill(src, [5])
    assert write_all(store, src, [5]) == {1: True}
    assert read_one(store, 5, dst[0]) and same_bytes(dst, src)


def test_uring_falls_back_to_sync_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(
        io_backends, "uring_probe", lambda directory=None: (False, "no ring (test)")
    )
    monkeypatch.setattr(io_backends, "_warned", set())
    with caplog.at_level(logging.WARNING):
        backends = [io_backends.make_backend("uring"), io_backends.make_backend("uring")]
    assert [b.name for b in backends] == ["sync", "sync"]
    assert [r.getMessage() for r in caplog.records] == [
        "io_uring is not usable here (no ring (test)); the NVMe store uses the 'sync' backend"
    ]
    for b in backends:
        b.close()


def test_uring_backend_is_chosen_where_usable():
    if not io_backends.uring_probe()[0]:
        pytest.skip(f"io_uring unusable here: {io_backends.uring_probe()[1]}")
    backend = io_backends.make_backend("uring")
    assert backend.name == "uring"
    backend.close()


@pytest.mark.parametrize("name", ["sync", "aiofiles", "uring"])
def test_a_backend_keeps_no_buffer_alive_and_no_object_an_io(tmp_path, name):
    """liburing's `Iovec` keeps a reference to every buffer it is given, for good: the uring
    backend must hand it views of its own, one a range of memory, not the callers' (each would
    keep a tensor's memory alive: a closed engine's whole CPU tier) nor one new object an I/O
    (the garbage collector walks each of them at every full collection)."""
    if name == "uring" and not io_backends.uring_probe(str(tmp_path))[0]:
        pytest.skip(f"io_uring unusable here: {io_backends.uring_probe(str(tmp_path))[1]}")
    backend = io_backends.make_backend(name)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 1 << 16)
    buffers = [aligned_empty(4096), aligned_empty(4096)]
    kept = [weakref.ref(b) for b in buffers]

    def run_ios(count: int) -> None:
        for tag in range(count):
            views = tuple(map(slot_format.byte_view, buffers))
            backend.submit([IORequest(tag, "write" if tag % 2 else "read", fd, 4096 * (tag % 4), views)])
            assert [c.result for c in backend.reap(5.0)] == [8192]

    try:
        run_ios(8)  # the first I/Os make what is made once (the backend's views, threads, ...)
        gc.collect()
        before = len(gc.get_objects())
        run_ios(200)
        gc.collect()
        assert len(gc.get_objects()) - before < 100  # not one an I/O (200 I/Os)
    finally:
        backend.close()
        os.close(fd)
    buffers.clear()
    gc.collect()
    assert all(ref() is None for ref in kept)


# ------------------------------------------------------------------ persistence


def test_restart_finds_blocks_and_other_fingerprints_do_not(open_store, backend_name):
    hashes = [11, 12, 13, 14, 15, 16]
    src, dst = cpu_pool(6), cpu_pool(6)
    fill(src, hashes)
    store = open_store(backend=backend_name)
    assert all(write_all(store, src, hashes).values())
    store.close()

    store = open_store(backend=backend_name)
    assert store.stats()["restored"] == 6 and all(store.contains(h) for h in hashes)
    assert all(read_one(store, h, dst[i]) for i, h in enumerate(hashes))
    assert same_bytes(dst, src)
    store.close()

    other = open_store(backend=backend_name, fingerprint=b"another model")
    assert other.stats()["restored"] == 0 and not any(other.contains(h) for h in hashes)
    assert read_one(other, 11, dst[0]) is None and other.stats()["misses"] == 1
    other_src = cpu_pool(2)
    fill(other_src, [11, 12])
    assert all(write_all(other, other_src, [11, 12]).values())  # same hashes, other model
    other.close()

    store = open_store(backend=backend_name)  # the other model took slots 0 and 1
    assert [h for h in hashes if store.contains(h)] == [13, 14, 15, 16]
    dst.zero_()
    assert all(read_one(store, h, dst[i]) for i, h in enumerate(hashes) if i >= 2)
    assert same_bytes(dst[2:], src[2:])


def test_restart_with_another_format_version_reuses_nothing(open_store, monkeypatch):
    src = cpu_pool(2)
    fill(src, [1, 2])
    store = open_store()
    write_all(store, src, [1, 2])
    store.close()
    monkeypatch.setattr(slot_format, "FORMAT_VERSION", slot_format.FORMAT_VERSION + 1)
    store = open_store()
    assert store.stats()["restored"] == 0 and not store.contains(1)


def test_restart_with_more_capacity_keeps_blocks(open_store):
    src = cpu_pool(3)
    fill(src, [1, 2, 3])
    store = open_store()
    write_all(store, src, [1, 2, 3])
    store.close()
    store = open_store(capacity_bytes=slots_capacity(20))
    assert store.num_slots == 20 and store.stats()["restored"] == 3


def test_second_store_on_the_same_file_is_refused(open_store):
    open_store()
    with pytest.raises(RuntimeError, match="used by another NVMeStore"):
        open_store()


# ------------------------------------------------------------------ LRU


def test_lru_eviction_order(open_store):
    a, b, c, d, e, f, g = range(1, 8)
    store = open_store(capacity_bytes=slots_capacity(4))
    pool, dst = cpu_pool(7), cpu_pool(1)
    fill(pool, [a, b, c, d, e, f, g])
    write_all(store, pool[:4], [a, b, c, d])
    assert store.index.stored_hashes() == [a, b, c, d]
    assert read_one(store, a, dst[0])  # a becomes the most recent
    write_all(store, pool[4:5], [e])  # evicts b
    assert store.index.stored_hashes() == [c, d, a, e] and not store.contains(b)
    write_all(store, pool[5:6], [f])  # evicts c
    assert store.submit_write(BlockRef(a, parent_of(a), tokens_of(a)), pool[0]) is None  # stored: touched
    write_all(store, pool[6:7], [g])  # evicts d
    assert store.index.stored_hashes() == [e, f, a, g]
    assert store.stats()["evictions"] == 3
    assert read_one(store, b, dst[0]) is None
    store.close()
    # Reads and touches are not persisted: after a restart the order is the order of writes.
    assert open_store(capacity_bytes=slots_capacity(4)).index.stored_hashes() == [a, e, f, g]


class GatedBackend(BlockIO):
    """Holds requests until `release()`, to keep I/O in flight as long as a test needs."""

    name = "gated"

    def __init__(self) -> None:
        self.inner, self.held, self.gate = SyncBackend(2), [], threading.Event()
        self.gate.set()

    def submit(self, requests: Sequence[IORequest]) -> None:
        if self.gate.is_set():
            self.inner.submit(requests)
        else:
            self.held.extend(requests)

    def release(self) -> None:
        self.gate.set()
        self.inner.submit(self.held)
        self.held = []

    def reap(self, timeout: float | None) -> list[IOCompletion]:
        return self.inner.reap(timeout)

    def close(self) -> None:
        self.inner.close()


def test_blocks_being_read_are_not_evicted(open_store):
    gated = GatedBackend()
    store = open_store(capacity_bytes=slots_capacity(2), backend=gated)
    pool, dst = cpu_pool(3), cpu_pool(2)
    fill(pool, [1, 2, 3])
    write_all(store, pool[:2], [1, 2])
    gated.gate.clear()
    reads = [store.submit_read(BlockRef(h, parent_of(h), tokens_of(h)), dst[i]) for i, h in enumerate((1, 2))]
    assert store.submit_write(BlockRef(3, parent_of(3), tokens_of(3)), pool[2]) is None  # both slots pinned
    assert store.stats()["write_rejected"] == 1
    gated.release()
    assert store.wait(reads) == dict.fromkeys(reads, True)
    assert all(write_all(store, pool[2:], [3]).values())
    assert store.index.stored_hashes() == [2, 3]


def test_a_lost_file_is_closed_when_the_last_job_on_it_ends(open_store):
    gated = GatedBackend()
    store = open_store(backend=gated)
    pool, dst = cpu_pool(2), cpu_pool(2)
    fill(pool, [1, 2])
    write_all(store, pool, [1, 2])

    def lost_and_open() -> bool:
        return any(os.readlink(f"/proc/self/fd/{fd}") == f"{store.path} (deleted)" for fd in os.listdir("/proc/self/fd")
                   if os.path.islink(f"/proc/self/fd/{fd}"))

    gated.gate.clear()
    held = store.submit_read(BlockRef(1, parent_of(1), tokens_of(1)), dst[0])
    os.unlink(store.path)
    time.sleep(LOOK_EVERY_S)
    assert store.submit_read(BlockRef(2, parent_of(2), tokens_of(2)), dst[1]) is None  # the loss is noticed
    assert store.stats()["files_lost"] == 1 and lost_and_open()  # a read still uses it
    gated.release()
    assert store.wait([held]) == {held: True} and same_bytes(dst[0], pool[0])
    assert not lost_and_open()  # closed with that read's completion: its space is back


def test_poll_reports_each_job_once_and_leaves_waited_ones(open_store):
    gated = GatedBackend()
    store = open_store(backend=gated)
    pool = cpu_pool(4)
    fill(pool, [1, 2, 3, 4])
    gated.gate.clear()
    jobs = [store.submit_write(BlockRef(h, parent_of(h), tokens_of(h)), pool[h - 1]) for h in (1, 2, 3, 4)]
    waiter = threading.Thread(target=lambda: results.update(store.wait(jobs[:2])))
    results: dict[int, bool] = {}
    waiter.start()
    gated.release()
    waiter.join()
    assert store.sync()
    assert results == {jobs[0]: True, jobs[1]: True}
    assert sorted(store.poll()) == [(jobs[2], True), (jobs[3], True)] and store.poll() == []


def test_threads_submitting_at_once(open_store):
    store = open_store(capacity_bytes=slots_capacity(64), queue_depth=8)
    pool, dst = cpu_pool(64), cpu_pool(64)
    fill(pool, range(1, 65))
    errors = []

    def worker(first: int) -> None:
        try:
            hashes = range(first, first + 16)
            assert all(write_all(store, pool[first - 1 : first + 15], hashes).values())
            jobs = [store.submit_read(BlockRef(h, parent_of(h), tokens_of(h)), dst[h - 1]) for h in hashes]
            assert all(store.wait(jobs).values())
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(1 + 16 * i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and same_bytes(dst, pool) and store.stats()["slots_used"] == 64


# ------------------------------------------------------------------ batched reads


class CountingBackend(BlockIO):
    """Passes requests on to another backend and notes each submit call's requests (their ops)."""

    def __init__(self, inner: BlockIO) -> None:
        self.inner, self.name, self.calls = inner, inner.name, []

    def submit(self, requests: Sequence[IORequest]) -> None:
        self.calls.append([req.op for req in requests])
        self.inner.submit(requests)

    def reap(self, timeout: float | None) -> list[IOCompletion]:
        return self.inner.reap(timeout)

    def close(self) -> None:
        self.inner.close()


def refs_into(dst: torch.Tensor, hashes: Sequence[int]) -> list[tuple[BlockRef, torch.Tensor]]:
    return [(BlockRef(h, parent_of(h), tokens_of(h)), dst[i]) for i, h in enumerate(hashes)]


def test_submit_reads_is_submit_read_block_by_block_up_to_the_first_miss(open_store, backend_name, tmp_path):
    """The store's batch starts the reads `submit_read` block by block (`BlockStore`'s default
    `submit_reads`) starts, and stops at the same miss: the same job ids, bytes, counters and
    LRU order; the blocks after the miss are neither read nor made recent."""
    stored, asked = [1, 2, 3, 5, 6], [1, 2, 3, 4, 5, 6]
    src = cpu_pool(5)
    fill(src, stored)
    outcomes = []
    for name, submit_reads in (("batched", NVMeStore.submit_reads), ("one by one", BlockStore.submit_reads)):
        store = open_store(path=tmp_path / name, backend=backend_name)
        write_all(store, src, stored)
        dst = cpu_pool(6)
        block_bytes_of(dst).fill_(0xAB)
        jobs = submit_reads(store, refs_into(dst, asked))
        done = store.wait(jobs)
        stats = store.stats()
        outcomes.append((jobs, done, stats["hits"], stats["misses"], store.index.stored_hashes(), dst))
    batched, one_by_one = outcomes
    assert batched[:5] == one_by_one[:5]
    jobs, done, hits, misses, lru_order, dst = batched
    assert len(jobs) == 3 and done == dict.fromkeys(jobs, True)
    assert (hits, misses, lru_order) == (3, 1, [5, 6, 1, 2, 3])
    assert same_bytes(dst[:3], src[:3]) and same_bytes(dst, one_by_one[5])
    assert bool((block_bytes_of(dst[3:]) == 0xAB).all())  # nothing read past the miss


def test_a_batch_of_reads_is_one_backend_submit(open_store, backend_name):
    """A batch of reads (up to `queue_depth`) reaches the backend in one call: for io_uring,
    one io_uring_submit, not one a block."""
    counting = CountingBackend(io_backends.make_backend(backend_name, 8))
    store = open_store(backend=counting, queue_depth=8)
    hashes = [11, 12, 13, 14, 15, 16]
    src, dst = cpu_pool(6), cpu_pool(6)
    fill(src, hashes)
    write_all(store, src, hashes)
    counting.calls.clear()
    jobs = store.submit_reads(refs_into(dst, hashes))
    assert counting.calls == [["read"] * 6]
    assert store.wait(jobs) == dict.fromkeys(jobs, True) and same_bytes(dst, src)


def test_a_batch_longer_than_the_queue_depth_all_completes(open_store, backend_name):
    """Reads beyond `queue_depth` queue for the issuing thread, which submits them as the first
    ones finish; every read completes, each block intact."""
    counting = CountingBackend(io_backends.make_backend(backend_name, 4))
    store = open_store(backend=counting, queue_depth=4, capacity_bytes=slots_capacity(16))
    hashes = list(range(21, 33))
    src, dst = cpu_pool(12), cpu_pool(12)
    fill(src, hashes)
    write_all(store, src, hashes)
    counting.calls.clear()
    jobs = store.submit_reads(refs_into(dst, hashes))
    assert len(jobs) == 12 and store.wait(jobs) == dict.fromkeys(jobs, True)
    assert same_bytes(dst, src) and store.stats()["hits"] == 12
    # the first ones in one submit (four, or fewer while the issuing thread still books the last
    # write: seen on a loaded 2-core machine); the rest as reads finish (one at a time, or a few
    # together when several finish at once), never more than the queue depth in flight
    assert 2 <= len(counting.calls[0]) <= 4 and sum(map(len, counting.calls)) == 12
    assert all(call == ["read"] * len(call) and len(call) <= 4 for call in counting.calls)


# ------------------------------------------------------------------ faults


def assert_still_works(store: NVMeStore, h: int = 999) -> None:
    src, dst = cpu_pool(1), cpu_pool(1)
    fill(src, [h])
    assert all(write_all(store, src, [h]).values())
    assert read_one(store, h, dst[0]) and same_bytes(dst, src)


@pytest.mark.parametrize(
    "fault, err, counter",
    [
        ("raise", errno.ENOSPC, "enospc"),
        ("raise", errno.EFBIG, "enospc"),  # a file-size limit fills the store as a full disk does
        ("raise", errno.EIO, "io_errors"),
        ("error", errno.ENOSPC, "enospc"),
        ("error", errno.EDQUOT, "enospc"),  # so does a quota
        ("error", errno.EIO, "io_errors"),
        ("short", 0, "short_writes"),
    ],
)
def test_write_faults_at_the_backend_seam(open_store, backend_name, fault, err, counter):
    faulty = FaultyBackend(io_backends.make_backend(backend_name, 4))
    store = open_store(backend=faulty)
    src = cpu_pool(1)
    fill(src, [7])
    faulty.inject("write", fault, err)
    job = store.submit_write(BlockRef(7, parent_of(7), tokens_of(7)), src[0])
    assert store.wait([job]) == {job: False}
    stats = store.stats()
    assert (
        stats[counter] == 1
        and stats["writes"] == 0
        and (stats["slots_used"], stats["slots_free"]) == (0, 8)
    )
    assert not store.contains(7)
    assert write_all(store, src, [7]) == {job + 1: True} and store.contains(7)  # a retry works
    assert_still_works(store)


@pytest.mark.parametrize(
    "fault, err, counter",
    [
        ("raise", errno.EIO, "io_errors"),
        ("error", errno.EIO, "io_errors"),
        ("short", 0, "short_reads"),
    ],
)
def test_read_faults_at_the_backend_seam(open_store, backend_name, fault, err, counter):
    faulty = FaultyBackend(io_backends.make_backend(backend_name, 4))
    store = open_store(backend=faulty)
    src, dst = cpu_pool(2), cpu_pool(1)
    fill(src, [7, 8])
    write_all(store, src, [7, 8])
    faulty.inject("read", fault, err)
    assert read_one(store, 7, dst[0]) is False
    stats = store.stats()
    assert stats[counter] == 1 and stats["hits"] == 0 and stats["slots_used"] == 1
    assert not store.contains(7) and store.contains(8)  # the slot is discarded, the other kept
    assert read_one(store, 7, dst[0]) is None
    assert read_one(store, 8, dst[0]) and same_bytes(dst[0], src[1])
    assert_still_works(store)


def test_faults_in_a_read_batch(open_store, backend_name):
    """A request that fails fails its own read only; a submit call that raises started none of
    its requests, so every read of the batch fails (each counted, its slot discarded)."""
    faulty = FaultyBackend(io_backends.make_backend(backend_name, 4))
    store = open_store(backend=faulty)
    hashes = [7, 8, 9]
    src, dst = cpu_pool(3), cpu_pool(3)
    fill(src, hashes)
    write_all(store, src, hashes)
    faulty.inject("read", "error", errno.EIO)
    jobs = store.submit_reads(refs_into(dst, hashes))
    assert list(store.wait(jobs).values()) == [False, True, True] and same_bytes(dst[1:], src[1:])
    assert store.stats()["io_errors"] == 1 and not store.contains(7) and store.contains(8)
    faulty.inject("read", "raise", errno.EIO)
    jobs = store.submit_reads(refs_into(dst[1:], hashes[1:]))
    assert list(store.wait(jobs).values()) == [False, False]
    stats = store.stats()
    assert stats["io_errors"] == 3 and stats["hits"] == 2 and stats["slots_used"] == 0
    assert_still_works(store)


def damage(store: NVMeStore, h: int, where: int) -> None:
    """Flip one byte of block h's slot, `where` bytes into it (header first, then payload)."""
    offset = store.geometry.slot_offset(store.index.lookup(h)) + where
    with open(store.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


@pytest.mark.parametrize(
    "where",
    [0, 30, 100, 4096, 4096 + BLOCK_BYTES - 1],
    ids=["magic", "hash", "tokens", "payload0", "payload-end"],
)
def test_damaged_slot_is_a_counted_failure(open_store, where):
    store = open_store()
    src, dst = cpu_pool(2), cpu_pool(1)
    fill(src, [7, 8])
    write_all(store, src, [7, 8])
    damage(store, 7, where)
    assert read_one(store, 7, dst[0]) is False
    assert store.stats()["corrupt"] == 1 and not store.contains(7)
    assert read_one(store, 8, dst[0]) and same_bytes(dst[0], src[1])
    assert_still_works(store)


def test_reading_with_other_tokens_or_parent_fails(open_store):
    store = open_store()
    src, dst = cpu_pool(1), cpu_pool(1)
    fill(src, [7])
    write_all(store, src, [7])
    job = store.submit_read(BlockRef(7, parent_of(7), [1] * BLOCK_SIZE), dst[0])  # a hash collision
    assert store.wait([job]) == {job: False} and store.stats()["corrupt"] == 1


def test_truncated_file(open_store):
    store = open_store()
    src, dst = cpu_pool(3), cpu_pool(1)
    fill(src, [1, 2, 3])
    write_all(store, src, [1, 2, 3])
    os.truncate(store.path, store.geometry.slot_offset(store.index.lookup(2)) + 100)
    assert read_one(store, 2, dst[0]) is False and read_one(store, 3, dst[0]) is False
    assert store.stats()["short_reads"] == 2
    assert read_one(store, 1, dst[0]) and same_bytes(dst[0], src[0])
    assert_still_works(store)


def test_deleted_file(open_store):
    store = open_store()
    src, dst = cpu_pool(2), cpu_pool(1)
    fill(src, [1, 2])
    write_all(store, src, [1, 2])
    os.unlink(store.path)
    time.sleep(LOOK_EVERY_S)
    assert read_one(store, 1, dst[0]) is None  # noticed at the next submit: every block is lost
    assert store.stats()["files_lost"] == 1 and not store.contains(2)
    assert_still_works(store)
    assert os.path.exists(store.path)
    store.close()
    assert open_store().stats()["restored"] == 1  # the block written after the loss


def test_bad_arguments_raise(open_store):
    store = open_store()
    block = cpu_pool(1)[0]
    with pytest.raises(ValueError, match="holds 8192 bytes"):
        store.submit_write(BlockRef(1, 0, tokens_of(1)), block.view(-1)[:4096])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.submit_read(BlockRef(1, 0, tokens_of(1)), block.transpose(0, 1))
    with pytest.raises(ValueError, match="more than block_size"):
        store.submit_write(BlockRef(1, 0, list(range(BLOCK_SIZE + 1))), block)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        store.submit_write(BlockRef(-1, 0, tokens_of(1)), block)
    with pytest.raises(KeyError, match="unknown"):
        store.wait([12345])
    with pytest.raises(ValueError, match="holds no slot"):
        NVMeStore(store.path + "x", 4096, BLOCK_BYTES, FP, BLOCK_SIZE, backend="sync")


# ------------------------------------------------------------------ crash


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from tests.test_nvme_store import BLOCK_BYTES, BLOCK_SIZE, FP, content_of, parent_of, tokens_of
    from tieredkv.tiers.backend import BlockRef
    from tieredkv.tiers.nvme.store import NVMeStore
    from tieredkv.tiers.nvme.slot_format import aligned_empty

    store = NVMeStore(sys.argv[1], int(sys.argv[2]), BLOCK_BYTES, FP, BLOCK_SIZE, backend="sync")
    ring = aligned_empty(16 * BLOCK_BYTES).view(16, BLOCK_BYTES)
    jobs = {}
    for h in range(1, 10**9):
        while len(jobs) >= 8:
            for job, _ in store.poll():
                jobs.pop(job, None)
        ring[h % 16].copy_(content_of(h))
        job = store.submit_write(BlockRef(h, parent_of(h), tokens_of(h)), ring[h % 16])
        if job is not None:
            jobs[job] = h
        if h == 200:
            print("written", flush=True)
    """
)


def test_writer_killed_mid_write_leaves_only_exact_slots(open_store, tmp_path):
    path = str(tmp_path / "kv")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, path, str(slots_capacity(24))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        started = select.select([child.stdout], [], [], 60)[0]
        line = child.stdout.readline() if started else b""
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert line == b"written\n", f"the writer did not start: {child.stderr.read().decode()[-2000:]}"
    store = open_store(path=path, capacity_bytes=slots_capacity(24))
    restored = store.index.stored_hashes()
    assert len(restored) >= 24 - 8  # slots not being written when it died have valid headers
    dst, good = cpu_pool(1), []
    for h in restored:
        if read_one(store, h, dst[0]):
            assert torch.equal(block_bytes_of(dst[0]), content_of(h)), f"block {h} verified wrong"
            good.append(h)
    assert len(good) >= len(restored) - 8  # at most the writes in flight can be torn
    assert store.stats()["corrupt"] == len(restored) - len(good)


def test_torn_writes_never_verify_after_restart(open_store):
    faulty = FaultyBackend(SyncBackend(2))
    store = open_store(capacity_bytes=slots_capacity(2), backend=faulty)
    src, dst = cpu_pool(4), cpu_pool(1)
    fill(src, [1, 2, 3, 4])
    write_all(store, src[:2], [1, 2])
    faulty.inject("write", "short")  # block 3 over block 1: new header, payload short of its end
    assert list(write_all(store, src[2:3], [3]).values()) == [False]
    slot_2 = store.index.lookup(2)
    store.close()
    with open(store.path, "r+b") as f:  # block 4's payload under block 2's header
        f.seek(store.geometry.slot_offset(slot_2) + store.geometry.header_bytes)
        f.write(block_bytes_of(src[3]).numpy().tobytes())
    store = open_store(capacity_bytes=slots_capacity(2))
    assert sorted(store.index.stored_hashes()) == [2, 3]  # both headers verify...
    assert (
        read_one(store, 3, dst[0]) is False and read_one(store, 2, dst[0]) is False
    )  # ...payloads don't
    assert store.stats()["corrupt"] == 2 and store.stats()["slots_free"] == 2
    assert_still_works(store)


# ------------------------------------------------------------------ asyncio


async def test_wait_async_from_a_running_loop(open_store):
    store = open_store(backend="aiofiles")
    hashes = [1, 2, 3, 4]
    src, dst = cpu_pool(4), cpu_pool(4)
    fill(src, hashes)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    jobs = [store.submit_write(BlockRef(h, parent_of(h), tokens_of(h)), src[i]) for i, h in enumerate(hashes)]
    assert all((await store.wait_async(jobs)).values())
    jobs = [store.submit_read(BlockRef(h, parent_of(h), tokens_of(h)), dst[i]) for i, h in enumerate(hashes)]
    assert all((await store.wait_async(jobs)).values())
    task.cancel()
    assert ticks > 0  # the loop kept running while the I/O was awaited
    assert same_bytes(dst, src)
    assert store.poll() == []  # each job is reported once
