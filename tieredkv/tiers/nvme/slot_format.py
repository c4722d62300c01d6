"""On-disk format of the NVMe block store: file layout, slot headers, aligned buffers.

One file holds a superblock and `num_slots` fixed-size slots; a slot holds one CPU block::

    offset 0            SUPERBLOCK_BYTES     + i * slot_bytes
    | superblock 4 KiB | slot 0 | slot 1 | ... | slot i                                  |
                                               | header (header_bytes) | payload, padded |
                                               |  4 KiB multiple       | to 4 KiB        |

Slot header (little endian; the header checksum covers bytes [16, 96 + 4 * num_tokens))::

    0 magic b"TKVSLOT\\0" | 8 header xxh3_64 | 16 format version u32 | 20 num_tokens u32
    24 block hash u64 | 32 parent hash u64 | 40 payload bytes u64 | 48 payload xxh3_64
    56 write sequence u64 | 64 fingerprint digest (32 bytes) | 96 token ids, u32 each

A slot is served only if every field matches what the reader expects and both checksums hold,
so a torn write (old header over new payload, half a header, ...) never verifies.

Operations: `SlotGeometry.for_block` (layout arithmetic), `pack_header` / `parse_header` /
`header_matches`, `pack_superblock` / `parse_superblock`, `fingerprint_digest`,
`aligned_empty` / `AlignedBufferPool` / `byte_view` / `is_aligned` (buffers for O_DIRECT),
`check_block` / `check_block_bytes` / `check_ids` (a caller's block and ids, as a store's submits take them).
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

FORMAT_VERSION = 1
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and addresses (covers 512 B and 4 KiB disks)
SUPERBLOCK_BYTES = ALIGN
SLOT_MAGIC = b"TKVSLOT\0"
STORE_MAGIC = b"TKVSTORE"
MAX_U64 = (1 << 64) - 1

_SLOT_FIXED = struct.Struct("<8sQIIQQQQQ32s")  # through the fingerprint digest: 96 bytes
_SUPER = struct.Struct(
    "<8sQIIQQQ"
)  # magic, checksum, version, header_bytes, slot_bytes, block_bytes, num_slots
_CHECKED_FROM = 16  # both checksums cover the bytes after magic and checksum


def align_up(n: int, alignment: int = ALIGN) -> int:
    """The smallest multiple of `alignment` that is >= n."""
    return -(-n // alignment) * alignment


def fingerprint_digest(fingerprint: bytes | int) -> bytes:
    """32 bytes that identify a model fingerprint (an int is taken as its 8 little-endian bytes)."""
    if isinstance(fingerprint, int):
        fingerprint = fingerprint.to_bytes(8, "little", signed=fingerprint < 0)
    return hashlib.blake2b(fingerprint, digest_size=32).digest()


@dataclass(frozen=True)
class SlotGeometry:
    """Sizes and offsets of the slots of one store file."""

    block_bytes: int
    block_size: int
    header_bytes: int
    payload_bytes: int  # block_bytes padded to ALIGN
    num_slots: int

    @classmethod
    def for_block(cls, capacity_bytes: int, block_bytes: int, block_size: int) -> SlotGeometry:
        """The geometry fitting the most slots for `block_bytes` blocks into `capacity_bytes`."""
        if block_bytes <= 0 or block_size <= 0:
            raise ValueError(
                f"block_bytes and block_size must be positive, got {block_bytes}, {block_size}"
            )
        header_bytes = align_up(_SLOT_FIXED.size + 4 * block_size)
        payload_bytes = align_up(block_bytes)
        num_slots = (capacity_bytes - SUPERBLOCK_BYTES) // (header_bytes + payload_bytes)
        if num_slots < 1:
            need = cls.min_capacity_bytes(block_bytes, block_size)
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no slot: give at least {need} bytes"
            )
        return cls(block_bytes, block_size, header_bytes, payload_bytes, num_slots)

    @staticmethod
    def min_capacity_bytes(block_bytes: int, block_size: int) -> int:
        """The smallest capacity that holds one slot: the superblock and one header and payload."""
        return SUPERBLOCK_BYTES + align_up(_SLOT_FIXED.size + 4 * block_size) + align_up(block_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes

    @property
    def file_bytes(self) -> int:
        return SUPERBLOCK_BYTES + self.num_slots * self.slot_bytes

    def slot_offset(self, slot: int) -> int:
        """File offset of the header of `slot`."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        return SUPERBLOCK_BYTES + slot * self.slot_bytes


@dataclass(frozen=True)
class SlotHeader:
    """The parsed header of one slot."""

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    payload_bytes: int
    payload_checksum: int
    sequence: int
    fingerprint: bytes  # the 32-byte digest


def pack_header(buf: memoryview, header: SlotHeader) -> None:
    """Write `header` into `buf` (header_bytes long); raises ValueError for out-of-range fields."""
    n = len(header.token_ids)
    end = _SLOT_FIXED.size + 4 * n
    if end > len(buf):
        raise ValueError(f"{n} token ids do not fit a {len(buf)}-byte slot header")
    for name in ("block_hash", "parent_hash"):
        if not 0 <= getattr(header, name) <= MAX_U64:
            raise ValueError(f"{name} must be an unsigned 64-bit int, got {getattr(header, name)}")
    try:
        struct.pack_into(f"<{n}I", buf, _SLOT_FIXED.size, *header.token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    _SLOT_FIXED.pack_into(
        buf,
        0,
        SLOT_MAGIC,
        0,
        FORMAT_VERSION,
        n,
        header.block_hash,
        header.parent_hash,
        header.payload_bytes,
        header.payload_checksum,
        header.sequence,
        header.fingerprint,
    )
    buf[end:] = bytes(len(buf) - end)
    struct.pack_into("<Q", buf, 8, xxhash.xxh3_64_intdigest(buf[_CHECKED_FROM:end]))


def parse_header(buf: memoryview, max_tokens: int | None = None) -> SlotHeader | None:
    """The header in `buf`, or None if it is not a valid header of this format version (with
    at most `max_tokens` tokens; None: as many as `buf` holds)."""
    magic, checksum, version, n, bhash, parent, nbytes, pcheck, seq, fp = _SLOT_FIXED.unpack_from(
        buf
    )
    if magic != SLOT_MAGIC or version != FORMAT_VERSION or (max_tokens is not None and n > max_tokens):
        return None
    end = _SLOT_FIXED.size + 4 * n
    if end > len(buf) or xxhash.xxh3_64_intdigest(buf[_CHECKED_FROM:end]) != checksum:
        return None
    tokens = struct.unpack_from(f"<{n}I", buf, _SLOT_FIXED.size)
    return SlotHeader(bhash, parent, tokens, nbytes, pcheck, seq, fp)


def header_matches(
    header: SlotHeader | None,
    fingerprint: bytes,
    block_hash: int,
    parent_hash: int,
    token_ids: Sequence[int],
    payload_bytes: int,
) -> bool:
    """True if `header` is the header a reader of this exact block expects."""
    return (
        header is not None
        and header.fingerprint == fingerprint
        and header.block_hash == block_hash
        and header.parent_hash == parent_hash
        and header.payload_bytes == payload_bytes
        and header.token_ids == tuple(token_ids)
    )


def pack_superblock(buf: memoryview, geometry: SlotGeometry) -> None:
    """Write the superblock describing `geometry` into `buf` (SUPERBLOCK_BYTES long)."""
    buf[:] = bytes(len(buf))
    g = geometry
    _SUPER.pack_into(
        buf,
        0,
        STORE_MAGIC,
        0,
        FORMAT_VERSION,
        g.header_bytes,
        g.slot_bytes,
        g.block_bytes,
        g.num_slots,
    )
    struct.pack_into("<Q", buf, 8, xxhash.xxh3_64_intdigest(buf[_CHECKED_FROM : _SUPER.size]))


def parse_superblock(buf: memoryview) -> tuple[int, int, int] | None:
    """(header_bytes, slot_bytes, block_bytes) of a valid superblock of this version, else None."""
    magic, checksum, version, header_bytes, slot_bytes, block_bytes, _ = _SUPER.unpack_from(buf)
    if magic != STORE_MAGIC or version != FORMAT_VERSION:
        return None
    if xxhash.xxh3_64_intdigest(buf[_CHECKED_FROM : _SUPER.size]) != checksum:
        return None
    return header_bytes, slot_bytes, block_bytes


def aligned_empty(nbytes: int, alignment: int = ALIGN) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes` whose address is a multiple of `alignment`.

    Use it (viewed as the KV dtype and shape) for a CPU pool that is not pinned, so that block
    I/O goes straight to and from its memory; pinned memory is page-aligned already.
    """
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = -raw.data_ptr() % alignment
    return raw[start : start + nbytes]


class AlignedBufferPool:
    """Reusable `aligned_empty(nbytes)` buffers; at most `limit` exist (None: no limit).

    `get` returns None when `limit` buffers are out. Thread-safe.
    """

    def __init__(self, nbytes: int, limit: int | None = None) -> None:
        self.nbytes, self.limit = nbytes, limit
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lock = threading.Lock()

    def get(self) -> torch.Tensor | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self.limit is not None and self._made >= self.limit:
                return None
            self._made += 1
        return aligned_empty(self.nbytes)

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of the bytes of a contiguous CPU tensor (shares its memory and keeps
    the tensor alive). Made without a torch operator: those release the GIL and wait to take it
    back, up to a switch interval (5 ms) each while other threads run Python, which made the
    reader threads of a remote tier wait longer than their reads."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"need a contiguous CPU tensor, got device={tensor.device} contiguous={tensor.is_contiguous()}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(bytearray())
    memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    memory.owner = tensor  # the view keeps `memory`, which keeps the tensor
    return memoryview(memory).cast("B")


def check_block_bytes(block: torch.Tensor, name: str, block_bytes: int, block_size: int, num_tokens: int) -> None:
    """ValueError saying what is wrong unless `block` (the argument called `name`) is one
    contiguous CPU block of `block_bytes` for at most `block_size` tokens (no torch operator)."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CPU tensor (a view of one CPU block)")
    nbytes = block.numel() * block.element_size()
    if nbytes != block_bytes:
        raise ValueError(f"{name} holds {nbytes} bytes; blocks are {block_bytes}")
    if num_tokens > block_size:
        raise ValueError(f"{num_tokens} token ids, more than block_size={block_size}")


def check_block(block: torch.Tensor, name: str, block_bytes: int, block_size: int, num_tokens: int) -> torch.Tensor:
    """The bytes of `block` as flat uint8, if `check_block_bytes` finds nothing wrong: `block`
    itself where it is that already (the CPU tier's `BlockViews`), with no torch operator."""
    check_block_bytes(block, name, block_bytes, block_size, num_tokens)
    if block.dtype == torch.uint8 and block.dim() == 1:
        return block
    return block.reshape(-1).view(torch.uint8)


def check_ids(block_hash: int, parent_hash: int, token_ids: Sequence[int]) -> tuple[int, ...]:
    """The token ids as a slot header holds them, if both hashes are unsigned 64-bit and every
    id unsigned 32-bit; else ValueError."""
    for name, value in (("block_hash", block_hash), ("parent_hash", parent_hash)):
        if not 0 <= value <= MAX_U64:
            raise ValueError(f"{name}={value} is not an unsigned 64-bit hash")
    tokens = tuple(token_ids)
    if not set(map(type, tokens)) <= {int}:  # numpy ints become ints; a bool, float or string is refused
        tokens = tuple(_as_int(t) for t in tokens)
    if tokens and not (min(tokens) >= 0 and max(tokens) < 1 << 32):  # no Python loop: it runs per block read
        raise ValueError("token ids must lie in [0, 2**32)")
    return tokens


def _as_int(token_id: object) -> int:
    """An integer token id as an int; ValueError for anything else (a float, a bool, a string)."""
    if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
        raise ValueError(f"token ids must be integers, got {token_id!r}")
    return token_id.__index__()


def is_aligned(tensor: torch.Tensor, alignment: int = ALIGN) -> bool:
    """True if the tensor's first byte sits on an `alignment` boundary."""
    return tensor.data_ptr() % alignment == 0
