"""The NVMe store's file: opened with O_DIRECT where the filesystem takes it, locked, preallocated.

Operations: `store_file(path)` (which file a store path names), `SlotFile(path, geometry, claim)`
(open or create), `.vanished()` (deleted or replaced under us, or its descriptor closed under
us: `.fd_lost()`), `.read_superblock()` /
`.holds_slots()` / `.wipe()` / `.format()`, `.scan(backend, fingerprint)` (the blocks whose slot
headers verify, for restarts), `.close()`, `remove_empty_dirs`.

Opening never harms what it did not make: a symbolic link is not followed; a non-empty file
without the store's magic is refused unless `claim` says the file is the store's own (a damaged
store file is then formatted anew); a store that does not fit the free space is refused before
any space is taken; and if preallocation fails, a file this call created is removed and a file
it grew is cut back to its old size.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from dataclasses import dataclass

from tieredkv.tiers.nvme.block_io import BlockIO, IORequest
from tieredkv.tiers.nvme.slot_format import (
    ALIGN,
    STORE_MAGIC,
    SUPERBLOCK_BYTES,
    SlotGeometry,
    aligned_empty,
    byte_view,
    pack_superblock,
    parse_header,
    parse_superblock,
)

logger = logging.getLogger(__name__)

STORE_FILE_NAME = "tieredkv-blocks.slots"  # the file used when the store's path is a directory

_warned_dirs: set[str] = set()


class StoreInUseError(RuntimeError):
    """Another NVMeStore (in this process or process `pid`; None: unknown) holds the file."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path, self.pid = path, pid
        super().__init__(f"{path} is used by another NVMeStore ({self.holder}); give each engine its own nvme_path")

    @property
    def holder(self) -> str:
        if self.pid is None:
            return "another process"
        return f"this process, pid {self.pid}" if self.pid == os.getpid() else f"process {self.pid}"


@dataclass(frozen=True)
class ScanResult:
    """What a scan of the slot headers found: (sequence, block hash, slot) of each block of
    this model, oldest write first, and the number of slots whose header is damaged;
    `reformatted`: there was no scan, a damaged file was formatted anew."""

    blocks: list[tuple[int, int, int]]
    damaged: int
    reformatted: bool = False


class SlotFile:
    """One open, exclusively locked, preallocated store file. `created`: this open made the
    file; `was_empty`: the file held no bytes before this open."""

    def __init__(self, path: str, geometry: SlotGeometry, claim: bool = False) -> None:
        """`claim`: the file is the store's own (its name in the store's directory), so a
        non-empty file without the store's magic is a damaged store, not someone's data."""
        self.path, self.geometry = path, geometry
        self.created = created = not os.path.lexists(path)
        self.fd, self.o_direct = _open(path)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(self.fd)
            os.close(self.fd)
            raise StoreInUseError(path, holder) from None
        st = os.fstat(self.fd)
        self.was_empty = st.st_size == 0
        try:
            self._check_contents(st, claim)
            _check_free_space(self.fd, path, geometry.file_bytes)
            _preallocate(self.fd, geometry.file_bytes)
        except BaseException:
            self._undo(created, st.st_size)
            raise
        st = os.fstat(self.fd)
        self._identity = (st.st_dev, st.st_ino)
        self._fd_lost = False

    def _check_contents(self, st: os.stat_result, claim: bool) -> None:
        """Refuse what is not a store file (lock held, nothing written yet)."""
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{self.path} is not a regular file; give a directory for the NVMe store")
        if self.was_empty or claim:
            return
        buf = aligned_empty(ALIGN)
        os.preadv(self.fd, [byte_view(buf)], 0)
        if bytes(byte_view(buf)[: len(STORE_MAGIC)]) != STORE_MAGIC:
            raise ValueError(
                f"{self.path} is a file of {st.st_size} bytes that is not an NVMe block store "
                "(no store header); it is left untouched: give a directory, a new path or an "
                "empty file"
            )

    def _undo(self, created: bool, size: int) -> None:
        """Opening failed after the lock: remove the file if this open created it, else cut it
        back to its old size; then close it."""
        try:
            if created:
                os.unlink(self.path)
            elif os.fstat(self.fd).st_size > size:
                os.ftruncate(self.fd, size)
        except OSError as exc:
            logger.error("NVMe store: cleaning up %s after a failed open failed: %s", self.path, exc)
        os.close(self.fd)
        self.fd = -1

    def vanished(self) -> bool:
        """True if `path` no longer names this file (deleted, or replaced by another), or the
        descriptor no longer does (`fd_lost`)."""
        if self.fd_lost():
            return True
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._identity

    def fd_lost(self) -> bool:
        """True if the descriptor no longer names this file: someone closed it under the store
        (its number may name another file by now). It is given up then (`fd` is -1), never
        used nor closed again."""
        if self._fd_lost or self.fd < 0:
            return self._fd_lost
        try:
            st = os.fstat(self.fd)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._identity:
            self._fd_lost, self.fd = True, -1
        return self._fd_lost

    def read_superblock(self) -> tuple[int, int, int] | None:
        """(header_bytes, slot_bytes, block_bytes) of a valid superblock of this format version."""
        buf = aligned_empty(SUPERBLOCK_BYTES)
        if os.preadv(self.fd, [byte_view(buf)], 0) != SUPERBLOCK_BYTES:
            return None
        return parse_superblock(byte_view(buf))

    def holds_slots(self) -> bool:
        """True if the superblock says the file holds slots of this geometry and format version."""
        g = self.geometry
        return self.read_superblock() == (g.header_bytes, g.slot_bytes, g.block_bytes)

    def wipe(self) -> None:
        """Drop every byte of the file (it reads as zeros, still preallocated); `format()` next."""
        os.ftruncate(self.fd, 0)
        _preallocate(self.fd, self.geometry.file_bytes)

    def format(self) -> None:
        """Write the superblock of this geometry (slot headers left as they are)."""
        buf = aligned_empty(SUPERBLOCK_BYTES)
        pack_superblock(byte_view(buf), self.geometry)
        os.pwritev(self.fd, [byte_view(buf)], 0)

    def scan(self, backend: BlockIO, fingerprint: bytes, batch: int = 64) -> ScanResult:
        """The slots whose header verifies for `fingerprint` (oldest write first; of two slots
        with one hash, the newer wins), and how many held a header that verifies for no model
        (another model's block, of another block size too, is skipped, not counted)."""
        g, found, damaged = self.geometry, {}, 0
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
                buf = bufs[slot - start]
                header = parse_header(byte_view(buf))
                if header is None:
                    damaged += bool(buf.any())  # never written slots read as zeros
                elif (
                    header.fingerprint == fingerprint
                    and len(header.token_ids) == g.block_size
                    and header.payload_bytes == g.block_bytes
                    and header.sequence > found.get(header.block_hash, (-1, -1))[0]
                ):
                    found[header.block_hash] = (header.sequence, slot)
        blocks = sorted((seq, h, slot) for h, (seq, slot) in found.items())
        return ScanResult(blocks, damaged)

    def close(self, sync: bool = True) -> None:
        """fsync (unless not `sync`: a lost file) and close (idempotent); an fsync failure is
        logged, not raised. A descriptor closed under the store is left alone (`fd_lost`)."""
        if self.fd < 0:
            return
        if self.fd_lost():
            logger.warning("NVMe store: the descriptor of %s was closed by someone else; not closing it", self.path)
            return
        try:
            if sync:
                os.fsync(self.fd)
        except OSError as exc:
            logger.warning("fsync of %s failed at close: %s", self.path, exc)
        os.close(self.fd)
        self.fd = -1


def _open(path: str) -> tuple[int, bool]:
    """(fd, O_DIRECT?): O_DIRECT where the filesystem takes it, else buffered with one warning.
    A symbolic link is refused (ValueError), not followed."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = -1
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
        os.preadv(fd, [byte_view(aligned_empty(ALIGN))], 0)  # some filesystems refuse only the I/O
        return fd, True
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if exc.errno == errno.ELOOP:
            raise ValueError(
                f"{path} is a symbolic link; the NVMe store does not follow links: give the real path"
            ) from None
        if exc.errno != errno.EINVAL:
            raise
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in _warned_dirs:
        _warned_dirs.add(directory)
        logger.warning(
            "%s does not take O_DIRECT; the NVMe store uses buffered I/O there", directory
        )
    return os.open(path, flags, 0o644), False


def lock_holder(fd: int) -> int | None:
    """The pid holding the flock on the file open at `fd`, from /proc/locks (Linux), else None."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as locks:
            lines = locks.readlines()
    except OSError:  # not Linux: the holder stays unknown
        return None
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            return int(fields[4])
    return None


def _check_free_space(fd: int, path: str, size: int) -> None:
    """Raise OSError(ENOSPC) if growing the file to `size` bytes needs more than the free space."""
    need = size - min(size, os.fstat(fd).st_blocks * 512)
    vfs = os.fstatvfs(fd)
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        raise OSError(
            errno.ENOSPC,
            f"the NVMe store needs {_gib(need)} more on the disk of {os.path.dirname(path)} but "
            f"{_gib(free)} are free",
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


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


def store_file(path: str | os.PathLike) -> tuple[str, str | None]:
    """The store file for `path`, and the directory made for it (None if none was made).

    A directory holds the file `STORE_FILE_NAME`; a missing path becomes such a directory; an
    existing file is the store file itself. A symbolic link to a file is refused."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return os.path.join(path, STORE_FILE_NAME), None
    if os.path.islink(path):
        raise ValueError(
            f"{path} is a symbolic link; the NVMe store does not follow links: give the real path"
        )
    if os.path.exists(path):
        return path, None
    top = path
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    os.makedirs(path)
    return os.path.join(path, STORE_FILE_NAME), top


def remove_empty_dirs(path: str, top: str) -> None:
    """Remove `path` and its parents up to `top`, while they are empty."""
    while True:
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == top:
            return
        path = os.path.dirname(path)
