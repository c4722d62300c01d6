"""The engine loop's host sections, and background threads that keep their Python out of them.

Every thread of a process runs Python under one lock, the GIL. The part of an engine step
before the GPU is given the step (schedule, tier bookkeeping, launch) is on every token's
path, and the GPU idles through it; while the engine waits for the GPU, the GIL is free. A
background thread that takes the GIL inside a host section costs the engine its own Python and
two hand-overs of the lock: the NVMe store's I/O threads cost the engine thread ~50–130 us a
block read or written (benchmarks/store_gil_cost.py), all of it on the decode steps' host time
when they land there. So the engine marks its host sections, and a background thread calls
`wait_turn()` before each burst of Python: it returns at once outside a host section, else when
the section ends, or after `MAX_DEFER_S` at most (a host section that long, a forward pass on
the CPU say, never stalls the I/O). With no section marked (a store used on its own) it always
returns at once.

One gate a process, as the GIL is one a process: sections of several engines in one process
(tests, replicas) add up.

Operations: `host_section()` (the engine), `wait_turn()` (background threads), `deferred_s()`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

MAX_DEFER_S = 0.005  # a background thread waits no longer than this for a section to end


class _Gate:
    """Open (set) while no host section runs."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._sections = 0
        self.deferred_s = 0.0  # background threads' time spent waiting for a section to end

    def enter(self) -> None:
        with self._lock:
            self._sections += 1
            self._open.clear()

    def leave(self) -> None:
        with self._lock:
            self._sections -= 1
            if self._sections == 0:
                self._open.set()

    def wait_turn(self) -> None:
        if self._open.is_set():
            return
        start = time.perf_counter()
        self._open.wait(MAX_DEFER_S)
        self.deferred_s += time.perf_counter() - start  # a race on a figure, never on state


_GATE = _Gate()


@contextlib.contextmanager
def host_section() -> Iterator[None]:
    """Mark the enclosed code as the engine loop's host section (module docstring)."""
    _GATE.enter()
    try:
        yield
    finally:
        _GATE.leave()


def wait_turn() -> None:
    """Before a burst of Python on a background thread: wait until no host section runs (at
    most `MAX_DEFER_S`)."""
    _GATE.wait_turn()


def deferred_s() -> float:
    """Seconds background threads of this process have waited for host sections to end."""
    return _GATE.deferred_s
