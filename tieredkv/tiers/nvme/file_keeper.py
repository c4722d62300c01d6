"""The NVMe store's file over its life: opened at start, noticed when deleted or replaced under
the store, kept open while jobs still use it, and made anew, with a backoff when that fails.

    files = FileKeeper(path, geometry)       # opens (or makes) the file; see `store_file`
    files.load(backend, fingerprint)         # the blocks it holds, or formats it (ScanResult)
    files.current                            # the open SlotFile, None while lost
    files.generation                         # bumped by each loss: a job's slot is of one file
    files.attach(job)                        # give a new job the current file, if there is one
    files.waiting()                          # lost, and too soon to try making a new one
    files.vanished(); files.retire_vanished() -> lost?   # the store then forgets its blocks
    files.close_unused(busy_generations)     # close the lost files no job uses any more
    files.open_for(job) -> fault | None      # SlotIO's `open_file`: make a new file if due
    files.close(); files.discard()           # at the end; after a failed open

`vanished` looks at the path (a `stat`) and at the descriptor (an `fstat`: someone may have closed
it under the store) at most every LOOK_EVERY_S: the store asks at every submit, thousands a
second, and a `stat` gives up the GIL to the I/O threads each time. Jobs
submitted in between use the lost file, which stays open: a read still reads what it holds, a
write is lost with it.

A lost file stays open while jobs of its generation run (their I/O must land somewhere), then is
closed so that its space returns. The first job submitted after a loss makes a new file (and
directory) on the issuing thread; if that fails (a full disk), jobs fail with `enospc` or
`io_errors` until a retry, after REOPEN_FIRST_S, then twice as long each time up to
REOPEN_MAX_S (logged once). Thread-safe; the store may call it holding its own lock, and it
never calls back into the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from tieredkv.tiers.nvme.block_io import BlockIO, fault_of
from tieredkv.tiers.nvme.slot_file import STORE_FILE_NAME, ScanResult, SlotFile, remove_empty_dirs, store_file
from tieredkv.tiers.nvme.slot_format import SlotGeometry
from tieredkv.tiers.nvme.slot_io import SlotJob

logger = logging.getLogger(__name__)

LOOK_EVERY_S = 0.05  # how often `vanished` looks at the path

REOPEN_FIRST_S, REOPEN_MAX_S = 1.0, 60.0  # waits before remaking a lost file after a failure


class FileKeeper:
    """The store's current SlotFile (None while lost), its generation, the lost files still in
    use, and when to try making a new one (module docstring)."""

    def __init__(self, path: str | os.PathLike, geometry: SlotGeometry) -> None:
        """Open the store file that `path` names (a missing path becomes a directory for it);
        on failure, remove the folders made for it."""
        self.path, self._made_dir = store_file(path)
        self.geometry = geometry
        self.generation = 0
        self._lock = threading.Lock()
        self._retired: dict[int, SlotFile] = {}  # generation -> a file lost under us, open while its jobs run
        self._reopen_at, self._reopen_wait = 0.0, REOPEN_FIRST_S  # no file: when to try making one
        self._reopen_fault = "io_errors"  # what jobs fail with while no file can be made
        self._next_look = 0.0  # when `vanished` may look at the path again
        try:
            self.current: SlotFile | None = SlotFile(self.path, geometry, self.owns_file)
        except BaseException:
            self._remove_made_dir()
            raise

    @property
    def owns_file(self) -> bool:
        """The file is the store's own (named by the store in a directory), so a damaged one
        may be formatted; a file the caller named must show the store's magic."""
        return os.path.basename(self.path) == STORE_FILE_NAME

    def load(self, backend: BlockIO, fingerprint: bytes) -> ScanResult:
        """The blocks an earlier store left in the file, or none once it is formatted (a file
        whose superblock is damaged or describes other slots is wiped first: `reformatted`)."""
        file = self.current
        if file.holds_slots():
            return file.scan(backend, fingerprint)
        reformatted = not file.was_empty
        if reformatted:
            why = "is damaged" if file.read_superblock() is None else "describes other slots"
            logger.warning("NVMe store %s: its superblock %s; formatting the file anew, its blocks are lost",
                           self.path, why)
            file.wipe()  # no stale or damaged slot header survives the format
        file.format()
        return ScanResult([], 0, reformatted)

    def attach(self, job: SlotJob) -> None:
        """Give a new job the current file; with none (lost), `open_for` makes one at issue."""
        file = self.current
        if file is not None:
            job.fd, job.o_direct = file.fd, file.o_direct

    def waiting(self) -> bool:
        """True while the file is lost and making a new one failed too recently to try again."""
        with self._lock:
            return self.current is None and time.monotonic() < self._reopen_at

    def vanished(self) -> bool:
        """True if the open file was deleted or replaced, or its descriptor closed (a quick look,
        without the lock; False until LOOK_EVERY_S after the last look)."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + LOOK_EVERY_S
        file = self.current
        return file is not None and file.vanished()

    def retire_vanished(self) -> bool:
        """If the file was deleted or replaced (or its descriptor closed), retire it (it stays
        open for the jobs that use it), start a new generation and return True; the next job
        makes a new file."""
        with self._lock:
            if self.current is None or not self.current.vanished():
                return False  # another thread noticed meanwhile
            what = "descriptor was closed under the store" if self.current.fd_lost() else "file vanished"
            logger.warning("NVMe store %s: its %s; its blocks are lost, starting anew", self.path, what)
            self._retired[self.generation] = self.current  # in-flight jobs may still use it
            self.generation += 1
            self.current, self._reopen_at, self._reopen_wait = None, 0.0, REOPEN_FIRST_S
            return True

    @property
    def has_retired(self) -> bool:
        """Whether a lost file is still open (read under the store's lock, which retires files)."""
        return bool(self._retired)

    def close_unused(self, busy: set[int]) -> None:
        """Close the lost files of generations not in `busy`, so that their space returns."""
        with self._lock:
            for generation in [g for g in self._retired if g not in busy]:
                self._retired.pop(generation).close(sync=False)

    def open_for(self, job: SlotJob) -> str | None:
        """On the issuing thread, for a job submitted while the file was lost: give it the file,
        making a new one unless a failure was too recent; else the fault the job fails with."""
        with self._lock:
            if self.current is None and time.monotonic() >= self._reopen_at:
                self._reopen_at = float("inf")  # this thread tries; jobs meanwhile fail
            elif self.current is None:
                return self._reopen_fault
            else:
                job.fd, job.o_direct = self.current.fd, self.current.o_direct
                return None
        file = None
        try:
            if self.owns_file:  # its directory may be gone with it
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
            file = SlotFile(self.path, self.geometry, self.owns_file)
            file.format()
        except (OSError, RuntimeError, ValueError) as exc:
            if file is not None:  # opened and locked, not formatted: kept open, it would lock out the next try
                file.close(sync=False)
            self._reopen_failed(exc)
            return self._reopen_fault
        with self._lock:  # nobody replaces a missing file but this thread
            if self._reopen_wait > REOPEN_FIRST_S:
                logger.warning("NVMe store: made a new file %s; storing blocks again", self.path)
            self.current, self._reopen_wait = file, REOPEN_FIRST_S
            job.fd, job.o_direct = file.fd, file.o_direct
        return None

    def _reopen_failed(self, exc: Exception) -> None:
        """Making a new file failed: wait before the next try, twice as long each time."""
        with self._lock:
            if self._reopen_wait == REOPEN_FIRST_S:
                logger.error("NVMe store cannot make a new file %s: %s; blocks are not stored until it can "
                             "(retrying after %.0f s, then up to every %.0f s)", self.path, exc, REOPEN_FIRST_S,
                             REOPEN_MAX_S)
            self._reopen_fault = fault_of(exc.errno) if isinstance(exc, OSError) else "io_errors"
            self._reopen_at = time.monotonic() + self._reopen_wait
            self._reopen_wait = min(2 * self._reopen_wait, REOPEN_MAX_S)

    def close(self) -> None:
        """Sync and close the file; close the lost ones still open."""
        with self._lock:
            if self.current is not None:
                self.current.close()
            for file in self._retired.values():
                file.close(sync=False)

    def discard(self) -> None:
        """Opening the store failed after the file was opened: close it, and remove it and the
        folders made for it if this open made them."""
        self.current.close()
        if self.current.created:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self._remove_made_dir()

    def _remove_made_dir(self) -> None:
        if self._made_dir is not None:
            remove_empty_dirs(os.path.dirname(self.path), self._made_dir)
