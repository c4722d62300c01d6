"""`ProcessCore`: the engine loop in an engine process of its own (this is the server's side).

A server's event loop sending tokens holds the GIL; an engine loop in the same process waits
for it on every step. In a process of its own ("spawn"; not daemonic, so it may start its
tensor-parallel ranks) the engine steps without waiting for the server.

This side sends requests, aborts and calls over a pipe, through a sender thread: a long prompt
fills the pipe faster than the engine process takes it between two steps, and the event loop,
which delivers every stream's tokens, must not wait for that. A reader thread receives (its
`recv` releases the GIL), rebuilds each step's outputs from their deltas and hands them to the
event loop in one call, to the sink. Which requests are open is the reader's to keep (under a lock):
it holds whatever loop sent them, even one closed since. If the engine process dies, every open
stream fails with a RuntimeError, and so does every later call: `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from typing import Any

from tieredkv.config import EngineConfig
from tieredkv.engine_core import NewRequest, OutputSink
from tieredkv.engine_core.child import run_engine
from tieredkv.engine_core.deltas import OutputRebuilder
from tieredkv.engine_core.info import EngineInfo
from tieredkv.engine_core.messages import (
    Abort,
    Call,
    CallName,
    Closed,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    StartFailed,
    StepOutputs,
)
from tieredkv.outputs import RequestOutput

logger = logging.getLogger(__name__)

_STOP = object()  # ends the sender thread
STATS_TIMEOUT_S = 30.0  # a stats call waits at most this long for the engine (it answers between steps)
STOP_TIMEOUT_S = 30.0  # `close` waits this long for the engine process to exit, then kills it


class ProcessCore:
    """Starts the engine process for `config` and waits until its engine is built (its error,
    if it fails to build: a ValueError for a bad config). Outputs go to `sink`."""

    def __init__(self, config: EngineConfig, sink: OutputSink) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=run_engine, args=(config, child_conn), name="tieredkv-engine", daemon=False)
        self._proc.start()
        child_conn.close()  # the child's end lives in the child only: its exit closes the pipe
        # runs before multiprocessing's own exit hook (registered earlier), which would wait for
        # a child that was never closed forever
        atexit.register(self._at_exit)
        try:
            self.info = self._started()
        except BaseException:
            atexit.unregister(self._at_exit)
            self._conn.close()
            raise
        self._sink = sink
        # under `_lock`: sends (from the event loop and `stats` callers), the calls waiting for
        # their replies, the requests not finished yet (the reader's), the engine's death
        self._lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._open: dict[str, OutputRebuilder] = {}
        self._idle = threading.Event()  # set while no request is open
        self._idle.set()
        self.error: RuntimeError | None = None  # set once the engine process has died
        self._closed_stats: dict[str, Any] | None = None  # the engine's stats once it closed (`Closed`)
        self._loop: asyncio.AbstractEventLoop | None = None  # where outputs go: the last sender's
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()  # to the engine, in order; `_STOP` ends it
        self._sender = threading.Thread(target=self._send_all, name="tieredkv-engine-sender", daemon=True)
        self._sender.start()
        self._reader = threading.Thread(target=self._read, name="tieredkv-engine-reader", daemon=True)
        self._reader.start()

    def _started(self) -> EngineInfo:
        try:
            message = self._conn.recv()
        except EOFError:
            self._proc.join()
            raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} while starting; "
                               "see its error above") from None
        if isinstance(message, StartFailed):
            self._proc.join()
            raise message.error
        assert isinstance(message, Ready), f"the engine process starts with Ready, got {type(message).__name__}"
        return message.info

    @property
    def healthy(self) -> bool:
        return self.error is None

    # ------------------------------------------------------------------ from the event loop

    def add(self, request: NewRequest) -> None:
        """Send a request (RuntimeError if the engine process is gone)."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            self._send_locked(request)
            self._open[request.request_id] = OutputRebuilder(request.prompt_token_ids)
            self._idle.clear()

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(RuntimeError):  # a dead engine holds nothing
            self._send(Abort(request_id))

    async def call(self, name: CallName) -> Any:
        """Run the engine's method `name` between two steps; its result."""
        return await asyncio.wrap_future(self._call(name))

    def stats(self) -> dict[str, Any]:
        """The engine's stats (blocks until it answers, between two steps; any thread); once
        the engine has closed, its last ones."""
        if self._closed_stats is not None:
            return self._closed_stats
        return self._call("stats").result(timeout=STATS_TIMEOUT_S)

    async def drained(self) -> None:
        """Return once every request sent has finished, been aborted or failed (and its last
        output was handed to this loop)."""
        while not self._idle.is_set():
            await asyncio.to_thread(self._idle.wait, 0.5)  # short waits: a cancelled one ends soon

    async def close(self) -> None:
        """Stop the engine process (it releases its tiers) and the reader, once the open
        requests have ended or `STOP_TIMEOUT_S` has passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drained(), STOP_TIMEOUT_S)
        await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        """Stop the engine process now (blocking; what `close` ends with)."""
        self._at_exit()
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        """The interpreter exits without `close`: tell the engine to shut down (closing our end
        alone would not: the reader thread's `recv` keeps the socket open)."""
        with contextlib.suppress(RuntimeError):  # it may have died already
            self._send(Shutdown())
        self._outbox.put(_STOP)
        self._sender.join(STOP_TIMEOUT_S)
        self._await_exit()
        self._conn.close()

    def _await_exit(self) -> None:
        """Wait for the engine process to exit, then kill it if it has not. The reader joins it
        (once the pipe closes): the only thread that does, as two waiting for one process race
        (the loser's join returns at once, the process alive to it)."""
        self._reader.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop; killing it")
            self._proc.kill()
            self._proc.join()

    def _send(self, message: object) -> None:
        """Send `message`; RuntimeError if the engine process is gone."""
        with self._lock:
            self._send_locked(message)

    def _send_locked(self, message: object) -> None:
        """Queue `message` for the sender thread (under `_lock`, so that it goes in the order
        the callers' state changed); RuntimeError if the engine process is gone."""
        if self.error is not None:
            raise self.error
        self._outbox.put(message)

    def _send_all(self) -> None:
        """The sender thread: the queued messages into the pipe, until `_STOP`. One the engine
        process does not take (it died) is dropped: the reader says so to every stream."""
        while (message := self._outbox.get()) is not _STOP:
            with contextlib.suppress(OSError):
                self._conn.send(message)

    def _call(self, name: CallName) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._send_locked(Call(call_id, name))
            self._calls[call_id] = done
        return done

    # ------------------------------------------------------------------ the reader thread

    def _read(self) -> None:
        """Receive until the connection closes; each message goes where it belongs."""
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, Reply):
                    self._settle(message)
                elif isinstance(message, StepOutputs):
                    self._post(self._sink.deliver, self._rebuild(message))
                elif isinstance(message, Closed):
                    self._closed_stats = message.stats
                elif isinstance(message, Rejected):
                    self._close_request(message.request_id)
                    self._post(self._sink.fail, message.request_id, message.error)
                else:  # StepFailed: the streams fail; their aborts come back as outputs
                    self._post(self._sink.fail, None, message.error)
        except (EOFError, OSError):
            pass
        except BaseException:
            logger.exception("the engine process's reader failed")
        self._died()

    def _rebuild(self, message: StepOutputs) -> list[RequestOutput]:
        """The step's outputs, rebuilt from their deltas; finished requests are closed."""
        outputs = []
        with self._lock:
            for delta in message.deltas:
                rebuilder = self._open.get(delta.request_id)
                if rebuilder is None:  # failed here already
                    continue
                outputs.append(rebuilder.apply(delta))
                if delta.finished:
                    del self._open[delta.request_id]
            self._mark_idle()
        return outputs

    def _close_request(self, request_id: str) -> None:
        with self._lock:
            self._open.pop(request_id, None)
            self._mark_idle()

    def _mark_idle(self) -> None:
        """Under `_lock`: wake `drained` once nothing is open."""
        if not self._open:
            self._idle.set()

    def _settle(self, reply: Reply) -> None:
        with self._lock:
            done = self._calls.pop(reply.call_id)
        if not done.set_running_or_notify_cancel():  # its caller gave up waiting
            return
        if reply.error is not None:
            done.set_exception(reply.error)
        else:
            done.set_result(reply.value)

    def _died(self) -> None:
        """The connection closed: by `close`, or because the engine process died. Every open
        request and call fails."""
        self._proc.join(STOP_TIMEOUT_S)
        with self._lock:
            self.error = RuntimeError(f"the engine process exited (code {self._proc.exitcode}); "
                                      "restart the server")
            calls, self._calls = self._calls, {}
            self._open.clear()
        for done in calls.values():
            if done.set_running_or_notify_cancel():
                done.set_exception(self.error)
        self._post(self._sink.fail, None, self.error)
        self._idle.set()

    def _post(self, callback: Any, *args: Any) -> None:
        """Run `callback(*args)` on the loop of the last sender (dropped if it has closed: its
        streams are gone with it)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(callback, *args)
