"""The remote store's record of the server's blocks and of what its jobs came to: the
`BlockIndex`, the writes on their way and the budget over the blocks this engine stored, the
`remote_*` counters (and which faults were said already), and the seconds with reads in flight.
It does no I/O; the store's submitting thread, its loop thread and its reader threads report to
it (thread-safe).

    ledger = Ledger(layout, budget_bytes)
    ledger.known_run(hashes) -> [stored?, ...]   # up to the first block known to be absent
    ledger.learn({block_hash: stored?})          # what the server said (EXISTS)
    ledger.admit_write(block_hash) -> [to delete] | None   # None: no write (see the method)
    ledger.wrote(block_hash, stored)             # True: sent; False: refused; None: there already
    ledger.reading(); ledger.book_read(block_hash, verdict); ledger.reads_done(count)
    ledger.failed(write_hashes, num_reads); ledger.error()    # jobs that did not run; a fault
    ledger.first_fault(kind)                     # True once per kind: the store logs it as a warning
    ledger.clear()                               # the server lost its blocks
    ledger.take_lost() -> LostBlocks             # blocks found gone, or all (cleared) since last asked
    ledger.stats() -> {"remote_...": n}; ledger.read_busy_s()
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence

from tieredkv.tiers.backend import LossLog, LostBlocks
from tieredkv.tiers.remote.index import BlockIndex
from tieredkv.tiers.remote.value_format import ValueLayout, Verdict

_COUNTERS = ("hit_blocks stored_blocks errors misses corrupt write_skipped evicted_blocks bytes_read "
             "bytes_written rejected_writes read_pipelines").split()


class Ledger:
    """What one engine has on record of a server's blocks, its counters, its read time (module
    docstring). `budget_bytes`: the most this engine stores (0: no limit of its own)."""

    def __init__(self, layout: ValueLayout, budget_bytes: int) -> None:
        self._layout, self._budget_blocks = layout, budget_bytes // layout.value_bytes
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter(dict.fromkeys(_COUNTERS, 0))
        self._said: set[str] = set()  # the kinds of fault logged as a warning already
        self._index = BlockIndex()
        self._lost = LossLog()  # blocks known stored that went (found gone, cleared), for `take_lost`
        self._writing: set[int] = set()
        # time with reads in flight: bytes read over it is the read bandwidth the engine gets
        self._reads_in_flight, self._read_busy_since, self._read_busy_s = 0, 0.0, 0.0

    def known_run(self, block_hashes: Iterable[int]) -> list[bool]:
        """Whether each of the leading blocks is known stored, up to the first block known to
        be absent (not included): the others are to be asked about."""
        with self._lock:
            known = []
            for block_hash in block_hashes:
                if self._index.absent(block_hash):
                    break
                known.append(self._index.stored(block_hash))
            return known

    def learn(self, found: dict[int, bool]) -> None:
        """The server said which blocks it holds: remember them (an absent one briefly)."""
        with self._lock:
            for block_hash, there in found.items():
                (self._index.remember if there else self._index.note_absent)(block_hash)

    def admit_write(self, block_hash: int) -> list[int] | None:
        """Take a write of the block: the blocks this engine stored and used least recently
        that must be deleted first to keep within the budget (forgotten here, counted as
        `evicted_blocks`). None, for no write: the block is being written, or is known stored
        (it becomes most recently used), or the writes in flight alone fill the budget
        (`rejected_writes`)."""
        with self._lock:
            if block_hash in self._writing:
                return None
            if self._index.stored(block_hash):
                self._index.touch(block_hash)
                return None
            doomed = self._index.make_room(self._budget_blocks, len(self._writing)) if self._budget_blocks else []
            if doomed is None:
                self._counts["rejected_writes"] += 1
                return None
            self._counts["evicted_blocks"] += len(doomed)
            self._writing.add(block_hash)
            return doomed

    def wrote(self, block_hash: int, stored: bool | None) -> None:
        """A write ended: `stored` True (sent), False (refused, e.g. out of memory) or None
        (the server had the block already)."""
        with self._lock:
            self._writing.discard(block_hash)
            if stored is None:
                self._counts["write_skipped"] += 1
                self._index.remember(block_hash)
            elif stored:
                self._counts["stored_blocks"] += 1
                self._counts["bytes_written"] += self._layout.value_bytes
                self._index.own(block_hash)
            else:
                self._counts["errors"] += 1

    def reading(self) -> None:
        """A read was submitted: it is in flight until `reads_done` or `failed` counts it."""
        with self._lock:
            if not self._reads_in_flight:
                self._read_busy_since = time.monotonic()
            self._reads_in_flight += 1

    def book_read(self, block_hash: int, verdict: Verdict) -> None:
        """Count the outcome of one read: a hit is used, a block that is missing or does not
        verify is forgotten."""
        with self._lock:
            if verdict == "ok":
                self._counts["hit_blocks"] += 1
                self._counts["bytes_read"] += self._layout.block_bytes
                self._index.touch(block_hash)
            else:
                self._counts["errors"] += 1
                self._counts["misses" if verdict == "missing" else "corrupt"] += 1
                self._index.forget(block_hash)
                self._lost.lose(block_hash)

    def reads_done(self, count: int) -> None:
        """One pipeline of `count` reads finished; the last read in flight ends the busy time."""
        if not count:
            return
        with self._lock:
            self._counts["read_pipelines"] += 1
            self._reads_in_flight -= count
            if not self._reads_in_flight:
                self._read_busy_s += time.monotonic() - self._read_busy_since

    def failed(self, write_hashes: Sequence[int], num_reads: int) -> None:
        """The jobs of a pipeline that did not run: each counts as an error."""
        with self._lock:
            self._counts["errors"] += len(write_hashes) + num_reads
            self._writing.difference_update(write_hashes)
        self.reads_done(num_reads)

    def error(self) -> None:
        """Count a failed operation that was no job (a lookup)."""
        with self._lock:
            self._counts["errors"] += 1

    def first_fault(self, kind: str) -> bool:
        """True the first time a fault of `kind` is said (the stats count every one)."""
        with self._lock:
            first = kind not in self._said
            self._said.add(kind)
            return first

    def clear(self) -> None:
        """The server's blocks are not the ones known (a new epoch): forget them all."""
        with self._lock:
            self._index.clear()
            self._lost.lose_all()

    def take_lost(self) -> LostBlocks:
        """The blocks known stored that went since the last call: found missing or damaged by a
        read, or all of them (the server lost its blocks). Not those deleted for the budget:
        that was this engine's choice."""
        with self._lock:
            return self._lost.take()

    def stats(self) -> dict[str, int | float]:
        """The counters as `remote_<name>`, `remote_owned_blocks` and `remote_read_busy_s`."""
        with self._lock:
            out: dict[str, int | float] = {f"remote_{name}": n for name, n in self._counts.items()}
            out["remote_owned_blocks"] = len(self._index.owned)
        out["remote_read_busy_s"] = self.read_busy_s()
        return out

    def read_busy_s(self) -> float:
        """Seconds with reads in flight so far (`remote_bytes_read` over it: the read bandwidth)."""
        with self._lock:
            busy = self._read_busy_s
            return busy + (time.monotonic() - self._read_busy_since if self._reads_in_flight else 0.0)
