"""The remote tier's direct reads (values received straight into their blocks) against the
reference path (a plain redis-py GET), byte for byte, against real redis-servers; and the read
bandwidth probe, which stops early on a slow server."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.remote_link import SlowLink
from tests.test_remote_store import FINGERPRINT, ref
from tieredkv.tiers.nvme.slot_format import byte_view
from tieredkv.tiers.remote import reader
from tieredkv.tiers.remote.store import RemoteStore
from tieredkv.tiers.remote.value_format import block_key


def blocks(count: int, block_bytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (count, block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("block_bytes, recv_chunk", [(3000, 1 << 20), (200_003, 1 << 20), (200_003, 4099)])
def test_direct_reads_equal_the_plain_get_byte_for_byte(redis_server, monkeypatch, block_bytes, recv_chunk):
    # values shorter and longer than the reply buffer (64 KiB), received whole or in odd pieces
    monkeypatch.setattr(reader, "RECV_CHUNK_BYTES", recv_chunk)
    src = blocks(40, block_bytes)
    dst = torch.zeros_like(src)
    client = redis_server.client()
    with RemoteStore(redis_server.url, block_bytes, FINGERPRINT, 4, read_threads=3, pipeline_ops=5) as store:
        jobs = [store.submit_write(ref(i), src[i]) for i in range(40)]
        assert all(store.wait(jobs, timeout=30).values())
        jobs = [store.submit_read(ref(i), dst[i]) for i in range(40)]
        assert all(store.wait(jobs, timeout=30).values())
        header_bytes = store.layout.header_bytes
    for i in range(40):
        value = client.get(block_key(FINGERPRINT, ref(i).block_hash))  # the reference path
        assert bytes(byte_view(dst[i])) == value[header_bytes:]
    assert torch.equal(dst, src)


def test_a_pipeline_with_missing_and_foreign_values_keeps_the_connection_in_step(redis_server):
    """A reply that is no block value (absent, too short, an error) is skipped whole: the
    values after it in the same pipeline still come back exact."""
    client = redis_server.client()
    src = blocks(6, 3000)
    dst = torch.zeros_like(src)
    with RemoteStore(redis_server.url, 3000, FINGERPRINT, 4, read_threads=1, pipeline_ops=8) as store:
        assert all(store.wait([store.submit_write(ref(i), src[i]) for i in range(6)], timeout=30).values())
        client.set(block_key(FINGERPRINT, ref(1).block_hash), b"x" * 70_000)  # wrong length, > the buffer
        client.delete(block_key(FINGERPRINT, ref(2).block_hash))
        key3 = block_key(FINGERPRINT, ref(3).block_hash)
        client.delete(key3)
        client.rpush(key3, b"a list")  # GET answers an error
        jobs = [store.submit_read(ref(i), dst[i]) for i in range(6)]
        assert list(store.wait(jobs, timeout=30).values()) == [True, False, False, False, True, True]
        stats = store.stats()
    assert [torch.equal(dst[i], src[i]) for i in (0, 4, 5)] == [True] * 3
    assert stats["remote_misses"] == 1 and stats["remote_corrupt"] == 2


def test_the_probe_stops_early_on_a_slow_server(redis_server):
    with SlowLink(redis_server.port, bytes_per_s=200_000) as link:
        with RemoteStore(link.url, 3000, FINGERPRINT, 4) as store:
            start = time.monotonic()
            rate = store.measure_read_bandwidth(max_blocks=256)
            took = time.monotonic() - start
    # 256 values of 7 KiB would take 9 s through the link; the probe stops after about 0.5 s
    assert took < 3.0
    assert rate is not None and rate < 400_000


def test_reads_submitted_while_the_readers_are_busy_go_out_together(redis_server):
    """Reads queued while every reader thread is busy leave in pipelines of several: the engine
    submits a prefix's reads one by one, and each must not cost a round trip of its own."""
    src = blocks(64, 3000)
    dst = torch.zeros_like(src)
    with RemoteStore(redis_server.url, 3000, FINGERPRINT, 4, read_threads=4, pipeline_ops=8) as store:
        assert all(store.wait([store.submit_write(ref(i), src[i]) for i in range(64)], timeout=30).values())
        release = threading.Event()
        busy = [store.reads.submit(release.wait, 30) for _ in range(store.reads.threads)]
        jobs = [store.submit_read(ref(i), dst[i]) for i in range(64)]  # all queued behind the busy readers
        release.set()
        assert all(f.result(30) for f in busy)
        assert all(store.wait(jobs, timeout=30).values())
        pipelines = store.stats()["remote_read_pipelines"]
    assert torch.equal(dst, src)
    assert pipelines <= 64 // 4, f"{pipelines} pipelines for 64 reads: they went out one by one"


def test_a_byte_view_writes_through_and_keeps_its_tensor():
    data = torch.zeros((4, 8), dtype=torch.int32)
    view = byte_view(data[2])
    assert view.nbytes == 32 and view.format == "B" and not view.readonly
    view[0:4] = (7).to_bytes(4, "little")
    assert data[2, 0] == 7
    alone = byte_view(torch.full((16,), 5, dtype=torch.uint8))  # the only reference to its tensor
    assert bytes(alone) == b"\x05" * 16
    assert byte_view(torch.empty(0)).nbytes == 0
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(data[:, 1])
