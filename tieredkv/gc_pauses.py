"""The garbage collector's pauses, which stop the engine loop wherever they fall.

A full collection walks every object the process tracks: an engine process holds hundreds of
thousands from its start (the model's modules, the tiers' block tables, what was imported), and
a walk of them takes ~0.1-0.3 s on the CPU machine. One is due once the objects that outlived
younger collections grow by a quarter of those; so a serving loop that leaves a few objects
behind every I/O or step (as the uring backend once did) stops for that long every so often.

`GCPauses`, while open, times every collection in the process (any thread's) for the engine's
stats: `gc_pause_s` in all, `gc_longest_pause_s`, `gc_full_collections` (the oldest generation's).
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GCPauses:
    """Times the collector's pauses from now until `close()`."""

    def __init__(self) -> None:
        self.pause_s = 0.0
        self.longest_s = 0.0
        self.full_collections = 0
        self._began = 0.0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        self.pause_s += took
        self.longest_s = max(self.longest_s, took)
        self.full_collections += info["generation"] == 2

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def stats(self) -> dict[str, float | int]:
        return {
            "gc_pause_s": self.pause_s,
            "gc_longest_pause_s": self.longest_s,
            "gc_full_collections": self.full_collections,
        }
