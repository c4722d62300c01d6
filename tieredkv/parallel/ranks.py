"""The worker processes of a tensor-parallel engine, as the driver sees them.

Operations:
- `Ranks(config, world)`: start one process per rank (forkserver: the server imports torch and
  transformers once, each rank is a fork of it) and wait until every rank has loaded its shard.
- `call(method, *args) -> [result per rank]`: run `Worker.<method>` on every rank.
- `shutdown()`: stop every rank (also done when the `Ranks` object is collected).

A rank that dies or fails is noticed while the driver waits for any reply (the process's
sentinel is waited on beside its pipe): the driver then stops every other rank (they may be
stuck in a collective with the dead one) and raises `RankFailure`; every later call raises it
again. Nothing waits on a dead rank.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import weakref
from multiprocessing import connection, reduction
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tieredkv.config import EngineConfig
from tieredkv.parallel.plan import REPORTED_ERROR_EXIT

logger = logging.getLogger(__name__)

PRELOAD = ["tieredkv.parallel.worker"]  # imported once by the fork server, not by every rank
STOP_TIMEOUT_S = 10.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or raised: the engine cannot go on (create a new one)."""


def _context() -> BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Ranks:
    """`world` worker processes and a pipe to each."""

    def __init__(self, config: EngineConfig, world: int) -> None:
        from tieredkv.parallel.worker import worker_main

        ctx = _context()
        # the ranks meet at this store (torch.distributed's rendezvous); the OS picks the port
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs: list[BaseProcess] = []
        self.conns: list[connection.Connection] = []
        self.failure: str | None = None
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        for rank in range(world):
            parent, child = ctx.Pipe()
            args = (config, rank, world, self._store.port, child, dict(os.environ))
            proc = ctx.Process(target=worker_main, args=args, name=f"tieredkv-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        # each rank reports once its shard is loaded (a ValueError: a setting the model cannot take)
        self.info: list[dict[str, Any]] = self.replies(settings=True)

    @property
    def world(self) -> int:
        return len(self.procs)

    def call(self, method: str, *args: Any, handles: list[int] | None = None, settings: bool = False) -> list[Any]:
        """`Worker.<method>(*args)` on every rank; their results in rank order. `handles`: one
        file descriptor per rank, passed to it after the call (the method receives it).
        `settings`: the call checks the caller's settings, a ValueError it raises is theirs
        (raised as such, after the ranks are stopped); otherwise any error is a RankFailure."""
        self.check()
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
                if handles is not None:
                    reduction.send_handle(conn, handles[rank], self.procs[rank].pid)
            except OSError:  # its end is closed: the rank is gone, `replies` says how
                pass
        return self.replies(settings)

    def replies(self, settings: bool = False) -> list[Any]:
        """One reply from every rank, in rank order; RankFailure if one died or raised
        (`settings`: see `call`)."""
        waiting = dict(enumerate(self.conns))
        results: dict[int, Any] = {}
        while waiting:
            sentinels = {self.procs[rank].sentinel: rank for rank in waiting}
            for ready in connection.wait([*waiting.values(), *sentinels]):
                rank = sentinels[ready] if ready in sentinels else self.conns.index(ready)
                if rank not in waiting or (ready in sentinels and waiting[rank].poll()):
                    continue  # read this rank's reply (it may say why it stopped) before its exit
                if ready in sentinels:
                    self._fail(self._death(rank))
                results[rank] = self._receive(rank, settings)
                del waiting[rank]
        return [results[rank] for rank in range(self.world)]

    def _receive(self, rank: int, settings: bool) -> Any:
        try:
            status, value = self.conns[rank].recv()
        except (EOFError, OSError):
            self.procs[rank].join(1.0)
            self._fail(self._death(rank))
        if status == "error":
            kind, message, trace = value
            logger.error("tensor-parallel rank %d failed:\n%s", rank, trace)
            dead = self._dead_rank(other_than=rank)
            if dead is not None:  # its collective broke because another rank died: name that one
                self._fail(f"{self._death(dead)} (rank {rank} then failed: {kind}: {message})")
            user_error = settings and kind == "ValueError"  # e.g. a KV tier that does not fit a GPU
            self._fail(f"tensor-parallel rank {rank} failed: {kind}: {message}",
                       ValueError(message) if user_error else None)
        return value

    def _dead_rank(self, other_than: int, grace_s: float = 1.0) -> int | None:
        """A rank (not `other_than`) that has died without a word (one that exited after
        reporting an error of its own is not it), waiting up to `grace_s` for one."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs) if rank != other_than}
        dead = []
        for sentinel in connection.wait(list(sentinels), grace_s):
            proc = self.procs[sentinels[sentinel]]
            proc.join(1.0)
            if proc.exitcode != REPORTED_ERROR_EXIT:
                dead.append(sentinels[sentinel])
        return min(dead, default=None)

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
        return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"

    def _fail(self, why: str, error: ValueError | None = None) -> None:
        self.failure = why
        logger.error("%s; stopping the other ranks", why)
        self._finalizer.detach()
        _stop(self.procs, self.conns, polite=False)  # the others may be stuck in a collective with it
        if error is not None:
            raise error
        raise RankFailure(f"{why}; the engine stopped every rank: create a new LLM to go on")

    def check(self) -> None:
        """RankFailure if a rank failed before (or the ranks were shut down)."""
        if self.failure is not None:
            raise RankFailure(f"the tensor-parallel ranks have stopped: {self.failure}")

    def shutdown(self) -> None:
        """Ask every rank to stop, then end those that do not (idempotent)."""
        if self.failure is None:
            self.failure = "the engine was closed"
        self._finalizer()


def _stop(procs: list[BaseProcess], conns: list[connection.Connection], polite: bool = True) -> None:
    """Stop the ranks: `polite`ly (asked, then given time) or at once by signal (a rank stuck
    in a collective with a dead one never reads its pipe)."""
    for proc, conn in zip(procs, conns, strict=False):
        if polite and proc.is_alive():
            try:
                conn.send_bytes(pickle.dumps(("shutdown", ())))
            except OSError:
                pass
    for proc in procs:
        proc.join(STOP_TIMEOUT_S if polite and proc.is_alive() else 0)
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
