"""A warm restart in the middle of a workload: the engine the clients talk to is closed and a
new one opened on the same config (and the same NVMe store) while the clients go on.

Operations:
- `EngineSlot(llm)`: the engine the clients use; `acquire()` before a request (it waits while a
  restart is under way), `release()` after it.
- `slot.restart_at(restart, config, start)`: at `restart.after_s` seconds after `start`, stop
  letting requests in, wait for those in flight to finish (none is lost), close the engine,
  remove the store file if `restart.store` is "empty", open the new engine (in a worker thread,
  so that the clients and the progress bar go on) and let the waiting requests in. `settle()`
  waits for a restart under way; `slot.record` says what happened.
- `restart_figures(restart, record, records, start)`: returning-request TTFT before and after
  the restart, what waited, and the first engine's final stats (for the summary).

    before ──────────────┤ began: drain ├ closed: store kept / emptied, new engine ├ ready ──── after
    requests sent here:    run on the old engine     wait at the door                   run on the new one

After the restart, what a kept store is worth shows on the first return of each conversation
(the history the old engine saw; the tag up to its last `/`, e.g. `user3` of `user3/turn5`): its
TTFT runs from the later of its sending and `ready`, so that the engine's downtime is reported
apart (`downtime_s`: closing, emptying the store, opening the new engine) and not mixed into it.
It is not the same whatever became of the store (a kept one is scanned, an emptied one
removed), and the requests sent during it queue up for the new engine: a longer downtime makes
a longer queue at `ready`.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from tieredkv.async_engine import AsyncLLM
from tieredkv.config import EngineConfig
from tieredkv.experiment.metrics import RequestRecord, percentiles
from tieredkv.experiment.spec import Restart

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartRecord:
    """What a restart did (monotonic seconds, as the request records)."""

    began: float  # no request let in from here
    closed: float  # the old engine closed (the store synced and unlocked)
    opening: float  # the store emptied (if asked): the new engine's build starts
    ready: float  # the new engine takes requests
    drained: int  # requests in flight at `began`: finished on the old engine
    waited: int  # requests sent between `began` and `ready`: run on the new engine
    store_removed_bytes: int | None  # "empty": the store file's size (0: there was none)
    stats_before: dict[str, Any]  # the old engine's stats() when it closed


class EngineSlot:
    """The engine the clients talk to; across a restart, requests wait for the new one."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm: AsyncLLM | None = llm
        self.record: RestartRecord | None = None
        self._open = asyncio.Event()  # set: requests are let in
        self._open.set()
        self._idle = asyncio.Event()  # set: no request in flight
        self._idle.set()
        self._in_flight = 0
        self._waited = 0
        self._last_stats: dict[str, Any] = {}
        self._restarting: asyncio.Task[RestartRecord] | None = None
        self._failed: BaseException | None = None  # the restart's error: no engine will open

    @property
    def serving(self) -> bool:
        """An engine is open (false only between closing the old engine and opening the new)."""
        return self.llm is not None

    @property
    def letting_in(self) -> bool:
        """Requests go to the engine at once (false while a restart is under way)."""
        return self._open.is_set()

    def stats(self) -> dict[str, Any]:
        """The open engine's stats; while none is, the old engine's last ones."""
        return self.llm.stats() if self.llm is not None else self._last_stats

    async def acquire(self) -> AsyncLLM:
        """The engine to send a request to; waits while a restart is under way (RuntimeError if
        it failed)."""
        if not self._open.is_set():
            self._waited += 1
            while not self._open.is_set():
                await self._open.wait()
        if self._failed is not None:
            raise RuntimeError(f"restart: no engine to send the request to: {self._failed}")
        assert self.llm is not None, "requests are let in only while an engine is open"
        self._in_flight += 1
        self._idle.clear()
        return self.llm

    def release(self) -> None:
        """A request from `acquire` has ended."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def restart_at(self, restart: Restart, config: EngineConfig, start: float) -> None:
        """Restart `restart.after_s` seconds after `start` (cancel it before then and nothing
        happens; once begun, the restart runs to its end: `settle()` waits for it)."""
        await asyncio.sleep(max(0.0, start + restart.after_s - time.monotonic()))
        self._restarting = asyncio.create_task(self._restart(restart, config))
        try:
            await asyncio.shield(self._restarting)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # waiting requests fail instead of waiting for ever
            self._failed = err
            self._open.set()
            raise

    async def settle(self) -> None:
        """Wait for a restart under way to finish (its error, if it failed, is raised here)."""
        if self._restarting is not None:
            await self._restarting

    async def close(self) -> None:
        if self.llm is not None:
            await self.llm.close()

    async def _restart(self, restart: Restart, config: EngineConfig) -> RestartRecord:
        began = time.monotonic()
        self._open.clear()
        drained = self._in_flight
        await self._idle.wait()
        old, self.llm = self.llm, None
        assert old is not None, "one restart at a time"
        old_process = old.engine_process  # the new engine runs where the old one did
        await old.close()  # writes what is worth keeping to the store first
        self._last_stats = old.stats()
        del old
        _free_memory()  # the new engine sizes its tiers from the memory left
        closed = time.monotonic()
        removed = _empty_store(config.cache.nvme_path) if restart.store == "empty" else None
        opening = time.monotonic()
        self.llm = await _open_engine(config, old_process)
        ready = time.monotonic()
        self.record = RestartRecord(began, closed, opening, ready, drained, self._waited, removed, self._last_stats)
        self._open.set()
        return self.record


async def _open_engine(config: EngineConfig, engine_process: bool) -> AsyncLLM:
    """A new engine, built in a worker thread; one whose build outlives a cancellation is
    closed, not leaked (it would hold the store's lock)."""
    build = asyncio.ensure_future(asyncio.to_thread(AsyncLLM, config=config, engine_process=engine_process))
    try:
        return await asyncio.shield(build)
    except asyncio.CancelledError:
        llm = await build
        await llm.close()
        raise


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _empty_store(nvme_path: str | None) -> int:
    """Remove the store file at `nvme_path` (a directory holding it, or the file), and those of
    tensor-parallel ranks (`tp<N>-rank<r>/` under the directory); their size."""
    from tieredkv.tiers.nvme import STORE_FILE_NAME

    if nvme_path is None:
        return 0
    if not os.path.isdir(nvme_path):
        return _remove_store_file(nvme_path)
    ranks = glob.glob(os.path.join(glob.escape(nvme_path), "tp*-rank*", STORE_FILE_NAME))
    return sum(_remove_store_file(f) for f in [os.path.join(nvme_path, STORE_FILE_NAME), *sorted(ranks)])


def _remove_store_file(file: str) -> int:
    try:
        size = os.path.getsize(file)
        os.remove(file)
    except FileNotFoundError:
        return 0
    logger.info("restart: removed the NVMe store %s (%.1f MiB)", file, size / 2**20)
    return size


# ---------------------------------------------------------------------------- figures


def conversation(record: RequestRecord) -> str:
    """The conversation (or document) a request belongs to: its tag up to the last `/`."""
    return record.tag.rsplit("/", 1)[0]


def restart_figures(restart: Restart, record: RestartRecord | None, records: list[RequestRecord],
                    start: float) -> dict[str, Any]:
    """The summary's `restart` section (seconds; times since `start`); `happened` is false when
    the workload ended before `restart.after_s`."""
    doc: dict[str, Any] = {"after_s": restart.after_s, "store": restart.store, "happened": record is not None}
    if record is None:
        return doc
    ok = [r for r in records if r.error is None and r.returning and r.token_times]
    before = [r.token_times[0] - r.arrival for r in ok if r.arrival < record.began]
    later = sorted((r for r in ok if r.arrival >= record.began), key=lambda r: r.arrival)
    first: dict[str, RequestRecord] = {}
    for r in later:
        first.setdefault(conversation(r), r)
    after = [_ttft_from_ready(r, record.ready) for r in first.values()]
    doc.update(
        began_s=record.began - start, closed_s=record.closed - start, opening_s=record.opening - start,
        ready_s=record.ready - start,
        downtime_s=record.ready - record.began, drained_requests=record.drained, waited_requests=record.waited,
        store_removed_bytes=record.store_removed_bytes,
        returning_before=len(before), returning_ttft_before_s=percentiles(before),
        returning_after=len(after), returning_ttft_after_s=percentiles(after),
        returning_after_all=len(later),
        returning_ttft_after_all_s=percentiles([_ttft_from_ready(r, record.ready) for r in later]),
        stats_before=record.stats_before,
    )
    return doc


def _ttft_from_ready(r: RequestRecord, ready: float) -> float:
    return r.token_times[0] - max(r.arrival, ready)
