"""The NVMe store's file: opened with O_DIRECT where the filesystem takes it, locked, preallocated.

Operations: `SlotFile(path, geometry)` (open or create), `.vanished()` (deleted or replaced
under us), `.holds_slots()` / `.format()` (superblock), `.scan(backend, fingerprint)` (the
blocks whose slot headers verify, for restarts), `.close()`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from tieredkv.tiers.nvme.io_backends import BlockIO, IORequest
from tieredkv.tiers.nvme.slot_format import (
    ALIGN,
    SUPERBLOCK_BYTES,
    SlotGeometry,
    aligned_empty,
    byte_view,
    pack_superblock,
    parse_header,
    parse_superblock,
)

logger = logging.getLogger(__name__)

_warned_dirs: set[str] = set()


class SlotFile:
    """One open, exclusively locked, preallocated store file."""

    def __init__(self, path: str, geometry: SlotGeometry) -> None:
        self.path, self.geometry = path, geometry
        self.fd, self.o_direct = _open(path)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _preallocate(self.fd, geometry.file_bytes)
        except BlockingIOError:
            os.close(self.fd)
            raise RuntimeError(
                f"{path} is used by another NVMeStore; give each engine its own nvme_path"
            ) from None
        except OSError:
            os.close(self.fd)
            raise
        st = os.fstat(self.fd)
        self._identity = (st.st_dev, st.st_ino)

    def vanished(self) -> bool:
        """True if `path` no longer names this file (deleted, or replaced by another)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._identity

    def holds_slots(self) -> bool:
        """True if the superblock says the file holds slots of this geometry and format version."""
        buf = aligned_empty(SUPERBLOCK_BYTES)
        if os.preadv(self.fd, [byte_view(buf)], 0) != SUPERBLOCK_BYTES:
            return False
        g = self.geometry
        return parse_superblock(byte_view(buf)) == (g.header_bytes, g.slot_bytes, g.block_bytes)

    def format(self) -> None:
        """Write the superblock of this geometry (slot headers left as they are)."""
        buf = aligned_empty(SUPERBLOCK_BYTES)
        pack_superblock(byte_view(buf), self.geometry)
        os.pwritev(self.fd, [byte_view(buf)], 0)

    def scan(
        self, backend: BlockIO, fingerprint: bytes, batch: int = 64
    ) -> list[tuple[int, int, int]]:
        """(sequence, block hash, slot) of each slot whose header verifies for `fingerprint`,
        oldest write first; of two slots with one hash, the newer wins."""
        g, found = self.geometry, {}
        bufs = [aligned_empty(g.header_bytes) for _ in range(min(batch, g.num_slots))]
        for start in range(0, g.num_slots, batch):
            slots = range(start, min(start + batch, g.num_slots))
            requests = [
                IORequest(s, "read", self.fd, g.slot_offset(s), (byte_view(bufs[s - start]),))
                for s in slots
            ]
            try:
                backend.submit(requests)
            except OSError as exc:
                logger.warning(
                    "NVMe store: reading slot headers %d..%d failed (%s)", start, slots[-1], exc
                )
                continue
            results: dict[int, int] = {}
            while len(results) < len(slots):
                results.update((c.tag, c.result) for c in backend.reap(1.0))
            for slot in (s for s in slots if results[s] == g.header_bytes):
                header = parse_header(byte_view(bufs[slot - start]), g.block_size)
                if (
                    header is not None
                    and header.fingerprint == fingerprint
                    and header.payload_bytes == g.block_bytes
                    and header.sequence > found.get(header.block_hash, (-1, -1))[0]
                ):
                    found[header.block_hash] = (header.sequence, slot)
        return sorted((seq, h, slot) for h, (seq, slot) in found.items())

    def close(self) -> None:
        """fsync and close (idempotent); an fsync failure is logged, not raised."""
        if self.fd < 0:
            return
        try:
            os.fsync(self.fd)
        except OSError as exc:
            logger.warning("fsync of %s failed at close: %s", self.path, exc)
        os.close(self.fd)
        self.fd = -1


def _open(path: str) -> tuple[int, bool]:
    """(fd, O_DIRECT?): O_DIRECT where the filesystem takes it, else buffered with one warning."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    fd = -1
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
        os.preadv(fd, [byte_view(aligned_empty(ALIGN))], 0)  # some filesystems refuse only the I/O
        return fd, True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    if fd >= 0:
        os.close(fd)
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in _warned_dirs:
        _warned_dirs.add(directory)
        logger.warning(
            "%s does not take O_DIRECT; the NVMe store uses buffered I/O there", directory
        )
    return os.open(path, flags, 0o644), False


def _preallocate(fd: int, size: int) -> None:
    """Make the file exactly `size` bytes, with its blocks allocated where the filesystem can."""
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)
