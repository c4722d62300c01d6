"""Slot headers and the slot index of the NVMe store: pure functions, no I/O."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tieredkv.tiers.nvme.slot_format import (
    SUPERBLOCK_BYTES,
    SlotGeometry,
    SlotHeader,
    aligned_empty,
    byte_view,
    check_ids,
    fingerprint_digest,
    header_matches,
    pack_header,
    pack_superblock,
    parse_header,
    parse_superblock,
)
from tieredkv.tiers.nvme.slot_index import Reservation, SlotIndex

FP = fingerprint_digest(b"model")
u64 = st.integers(0, 2**64 - 1)
headers = st.builds(
    SlotHeader,
    block_hash=u64,
    parent_hash=u64,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=16).map(tuple),
    payload_bytes=st.integers(1, 2**40),
    payload_checksum=u64,
    sequence=u64,
    fingerprint=st.just(FP),
)


def packed(header: SlotHeader) -> memoryview:
    buf = byte_view(aligned_empty(4096))
    pack_header(buf, header)
    return buf


@given(headers)
def test_header_round_trip(header):
    assert parse_header(packed(header), max_tokens=16) == header


@given(headers, st.data())
def test_any_flipped_header_byte_is_caught(header, data):
    buf = packed(header)
    used = 96 + 4 * len(header.token_ids)
    i = data.draw(st.integers(0, used - 1))
    buf[i] ^= data.draw(st.integers(1, 255))
    parsed = parse_header(buf, max_tokens=16)
    assert not header_matches(
        parsed, FP, header.block_hash, header.parent_hash, header.token_ids, header.payload_bytes
    )


def test_header_rejects_out_of_range_fields():
    good = SlotHeader(1, 2, (3,), 4096, 5, 6, FP)
    with pytest.raises(ValueError, match="token ids"):
        pack_header(byte_view(aligned_empty(4096)), SlotHeader(1, 2, (2**32,), 4096, 5, 6, FP))
    with pytest.raises(ValueError, match="parent_hash"):
        pack_header(byte_view(aligned_empty(4096)), SlotHeader(1, -2, (3,), 4096, 5, 6, FP))
    assert parse_header(packed(good), max_tokens=0) is None  # more tokens than a block holds


def test_token_ids_are_checked_as_a_header_holds_them():
    assert check_ids(1, 2, [3, 4]) == (3, 4)
    assert check_ids(1, 2, (np.int64(3), np.uint32(4))) == (3, 4)  # numpy ints come back as ints
    assert check_ids(1, 2, ()) == ()
    for bad, what in (([1.0], "integers"), ([True], "integers"), (["5"], "integers"), ([-1], r"\[0, 2\*\*32\)"),
                      ([2**32], r"\[0, 2\*\*32\)")):
        with pytest.raises(ValueError, match=what):
            check_ids(1, 2, bad)
    with pytest.raises(ValueError, match="parent_hash"):
        check_ids(1, -1, [3])


def test_geometry_and_superblock():
    g = SlotGeometry.for_block(SUPERBLOCK_BYTES + 3 * (4096 + 12288) + 100, 10_000, 16)
    assert (g.header_bytes, g.payload_bytes, g.num_slots) == (4096, 12288, 3)
    assert [g.slot_offset(s) for s in range(3)] == [4096, 4096 + 16384, 4096 + 2 * 16384]
    assert SlotGeometry.for_block(1 << 30, 2 << 20, 1024).header_bytes == 8192  # 1024 token ids
    buf = byte_view(aligned_empty(SUPERBLOCK_BYTES))
    pack_superblock(buf, g)
    assert parse_superblock(buf) == (4096, 16384, 10_000)
    buf[20] ^= 1
    assert parse_superblock(buf) is None


def stored(index: SlotIndex, *hashes: int) -> None:
    for h in hashes:
        assert index.reserve(h) is not None
        index.commit(h)


def test_index_evicts_least_recently_used_unpinned():
    index = SlotIndex(3)
    stored(index, 10, 11, 12)
    assert index.pin(10) == 0  # 10 is now the newest and busy
    assert index.reserve(13) == Reservation(slot=1, evicted=11)
    index.commit(13)
    index.touch(12)
    assert index.stored_hashes() == [10, 13, 12]
    assert index.reserve(14) == Reservation(slot=1, evicted=13)  # 10 is older but pinned
    index.abort(14)
    assert index.num_free == 1 and not index.known(14)


def test_index_all_pinned_means_no_slot():
    index = SlotIndex(2)
    stored(index, 1, 2)
    index.pin(1)
    index.pin(2)
    assert index.reserve(3) is None
    index.unpin(index.lookup(1))
    assert index.reserve(3) == Reservation(slot=0, evicted=1)


def test_discarded_slot_is_freed_after_its_last_read():
    index = SlotIndex(1)
    stored(index, 1)
    slot = index.pin(1)
    index.pin(1)
    index.discard(1)
    assert index.lookup(1) is None and index.num_free == 0
    index.unpin(slot)
    assert index.num_free == 0
    index.unpin(slot)
    assert index.num_free == 1 and index.reserve(2) == Reservation(slot=0, evicted=None)


def test_restore_keeps_order_and_frees_the_rest():
    index = SlotIndex(4)
    index.restore([(7, 2), (5, 0)])
    assert index.stored_hashes() == [7, 5] and index.num_free == 2
    assert index.reserve(9) == Reservation(slot=1, evicted=None)


def test_a_cpu_tier_block_goes_to_the_store_as_it_is():
    """The CPU tier's block views are the blocks' bytes, made once; the store takes one without
    a torch operator (each gives up the GIL, which the I/O threads then hold for a switch
    interval, many times a step)."""
    from tieredkv.tiers.cpu import CPUTier
    from tieredkv.tiers.nvme.slot_format import check_block

    tier = CPUTier(4, (2, 2, 16, 2, 8), torch.bfloat16, pin=False)
    tier.data[2].normal_()
    view = tier.blocks[2]
    assert view is tier.blocks[2] and view.dtype == torch.uint8 and view.dim() == 1
    assert view.data_ptr() == tier.data[2].data_ptr()
    assert bytes(view.numpy()) == bytes(tier.data[2].view(torch.uint8).numpy())
    assert check_block(view, "dst", view.numel(), 16, 16) is view
    shaped = check_block(tier.data[2], "dst", view.numel(), 16, 16)  # any other layout is viewed as bytes
    assert shaped.dtype == torch.uint8 and shaped.data_ptr() == view.data_ptr()
