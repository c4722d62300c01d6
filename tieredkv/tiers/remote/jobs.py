"""Two-phase job bookkeeping shared by a store's submitting thread and its I/O thread.

    book = JobBook()
    job = book.start()           # submitting thread
    book.finish(job, ok)         # I/O thread
    book.poll() -> [(job, ok)]   # finished since the last poll, except jobs a wait() claims
    book.wait([job]) -> {job: ok}
    book.drain(timeout)          # until nothing is in flight
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable


class JobBook:
    """Job ids in flight and finished-but-unreported results, with blocking waits. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._in_flight: set[int] = set()
        self._done: dict[int, bool] = {}
        self._claimed: set[int] = set()  # ids some wait() waits for: poll() leaves them

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def start(self) -> int:
        with self._cond:
            job = next(self._ids)
            self._in_flight.add(job)
        return job

    def finish(self, job: int, ok: bool) -> None:
        with self._cond:
            assert job in self._in_flight, f"job {job} finished twice or never started"
            self._in_flight.discard(job)
            self._done[job] = ok
            self._cond.notify_all()

    def poll(self) -> list[tuple[int, bool]]:
        """(job, ok) of the jobs finished since the last poll, in finishing order."""
        with self._cond:
            done = [(job, ok) for job, ok in self._done.items() if job not in self._claimed]
            for job, _ in done:
                del self._done[job]
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
        """Block until the jobs finished; {job: ok}. They are not reported by poll() again."""
        ids = list(job_ids)
        with self._cond:
            bad = [j for j in ids if j in self._claimed or (j not in self._in_flight and j not in self._done)]
            if bad:
                raise KeyError(f"job ids {bad[:8]} are unknown, reported already, or waited for elsewhere")
            self._claimed.update(ids)
            try:
                if not self._cond.wait_for(lambda: all(j in self._done for j in ids), timeout):
                    left = [j for j in ids if j not in self._done]
                    raise TimeoutError(f"jobs {left[:8]} not finished after {timeout} s")
                return {j: self._done.pop(j) for j in ids}
            finally:
                self._claimed.difference_update(ids)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is in flight; False if some still were after `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_flight, timeout)
