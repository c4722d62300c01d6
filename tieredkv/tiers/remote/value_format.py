"""What a block looks like on the remote server: a key per block, a value with an NVMe slot header.

    key   = "tieredkv:<fingerprint, 16 hex>:<block hash, 16 hex>"
    value = | slot header (header_bytes, as on NVMe) | payload: the CPU block's bytes |

The header is the NVMe slot header (`tiers/nvme/slot_format.py`): magic, format version, model
fingerprint digest, chained hash, parent hash, token ids, payload length and payload xxh3, with
its own checksum. A value is served only if every field is what the reader expects, the value is
exactly header + block long and the payload checksum holds: anything else (a truncated value,
garbage, another model's block) is a miss, never wrong KV. Reads receive the header and the
payload apart (`reader.py`: the payload straight into the destination block) and verify them in
place.

Operations: `ValueLayout.for_block`, `block_key`, `epoch_key`, `ValueLayout.pack`,
`ValueLayout.verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import xxhash

from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.nvme.slot_format import (
    SlotGeometry,
    SlotHeader,
    fingerprint_digest,
    header_matches,
    pack_header,
    parse_header,
)

KEY_PREFIX = "tieredkv"
Verdict = Literal["ok", "missing", "corrupt"]


def block_key(fingerprint: int, block_hash: int) -> str:
    """The key of one block of the model with this fingerprint."""
    return f"{KEY_PREFIX}:{fingerprint & (2**64 - 1):016x}:{block_hash:016x}"


def epoch_key(fingerprint: int) -> str:
    """A key whose value changes when the server lost its blocks (restarted empty, flushed)."""
    return f"{KEY_PREFIX}:{fingerprint & (2**64 - 1):016x}:epoch"


@dataclass(frozen=True)
class ValueLayout:
    """Sizes of the values of one model's blocks, and its fingerprint digest."""

    block_bytes: int
    block_size: int
    header_bytes: int
    fingerprint: bytes  # the 32-byte digest the headers carry

    @classmethod
    def for_block(cls, block_bytes: int, block_size: int, fingerprint: int) -> ValueLayout:
        """The layout of `block_bytes` blocks of `block_size` tokens, with the NVMe header size."""
        capacity = SlotGeometry.min_capacity_bytes(block_bytes, block_size)
        header_bytes = SlotGeometry.for_block(capacity, block_bytes, block_size).header_bytes
        return cls(block_bytes, block_size, header_bytes, fingerprint_digest(fingerprint))

    @property
    def value_bytes(self) -> int:
        return self.header_bytes + self.block_bytes

    def pack(self, ref: BlockRef, src: memoryview) -> memoryview:
        """A new value holding the header of `ref` and a copy of the block's bytes `src`."""
        view = memoryview(bytearray(self.value_bytes))
        view[self.header_bytes :] = src
        checksum = xxhash.xxh3_64_intdigest(view[self.header_bytes :])
        header = SlotHeader(ref.block_hash, ref.parent_hash, tuple(ref.token_ids), self.block_bytes, checksum, 0,
                            self.fingerprint)
        pack_header(view[: self.header_bytes], header)
        return view

    def verify(self, ref: BlockRef, received: bool | None, head: memoryview, payload: memoryview) -> Verdict:
        """Check a value received as `head` (its header) and `payload` (the block's bytes, in
        place) against `ref`; `received`: whether a value of the right length came at all
        (None: no such key)."""
        if received is None:
            return "missing"
        if not received:
            return "corrupt"
        header = parse_header(head, self.block_size)
        expected = (ref.block_hash, ref.parent_hash, ref.token_ids, self.block_bytes)
        if not header_matches(header, self.fingerprint, *expected):
            return "corrupt"
        if xxhash.xxh3_64_intdigest(payload) != header.payload_checksum:
            return "corrupt"
        return "ok"
