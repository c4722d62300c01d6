"""`ThreadCore`: the engine loop in a thread of this process.

The loop steps while there is work, so it never waits for the event loop between two steps;
with no request left it tends the tiers while their I/O goes on (writes to disk), until a
request comes or `drained` is awaited.
Only that thread changes the engine: requests added or aborted, and calls of its methods
(`call`: a prefix-cache reset, the CPU tier's trace), are handed to it under a lock and applied
between steps. Each step's outputs go to the event loop in one batch (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from tieredkv.engine import LLMEngine
from tieredkv.engine_core import NewRequest, OutputSink
from tieredkv.engine_core.messages import CallName
from tieredkv.outputs import RequestOutput

logger = logging.getLogger(__name__)


class ThreadCore:
    """Runs `engine` in a thread while it has work; outputs go to `sink` on the event loop.
    `engine` may be replaced before the first request (a subclass that instruments `step`)."""

    healthy = True  # a failed step fails its requests; the loop takes new ones

    def __init__(self, engine: LLMEngine, sink: OutputSink) -> None:
        self.engine, self._sink = engine, sink
        # handed from the event loop to the engine thread, under `_lock`
        self._lock = threading.Lock()
        self._pending: list[NewRequest] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[CallName, asyncio.Future[Any]]] = []
        self._thread: threading.Thread | None = None  # alive while the engine has work
        self._stop_tending = False  # set while someone waits for the thread to stop (`drained`)
        self._wake = threading.Event()  # ends the thread's tending pause: a hand-over, or `drained`
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, request: NewRequest) -> None:
        """Queue a request before the next step."""
        self._hand_over(self._pending, request)

    def abort(self, request_id: str) -> None:
        """End a request before the next step; its last output goes to the sink."""
        self._hand_over(self._aborts, request_id)

    async def call(self, name: CallName) -> Any:
        """Run the engine's method `name` between two steps; its result."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._hand_over(self._calls, (name, done))
        return await done

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def drained(self) -> None:
        """Return once the engine thread has stopped (no work left, or the engine failed), and
        the outputs it posted before have been delivered. Any event loop may wait: the thread
        may have been started from another one, since closed."""
        while True:
            with self._lock:
                thread = self._thread
                self._stop_tending = True  # the tiers' I/O between requests waits for the next one
                self._wake.set()
            if thread is None:
                return
            # the join's result is posted to this loop after everything the thread posted to it
            await asyncio.to_thread(thread.join)

    async def close(self) -> None:
        """Release the engine's tiers, once every request has ended."""
        await self.drained()
        self.engine.close()

    # ------------------------------------------------------------------ the engine thread

    def _hand_over(self, queue: list, item: object) -> None:
        """Give the engine thread a request, an abort or a call; start the thread if it is
        not running (it stops when the engine runs out of work)."""
        with self._lock:
            queue.append(item)
            self._wake.set()
            if self._thread is None:
                self._stop_tending = False
                self._loop = asyncio.get_running_loop()
                self._thread = threading.Thread(target=self._run, name="tieredkv-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        """Step while there is work; each step's outputs go to the event loop in one batch."""
        loop = self._loop  # this thread's: a later thread gets its own
        assert loop is not None, "started by _hand_over"
        try:
            self._step_while_busy(loop)
        except Exception as err:  # the engine broke: every waiting stream gets the error
            if loop.is_closed():  # nobody is left to deliver to (the event loop ended with requests open)
                with self._lock:
                    self._thread = None
                return
            logger.exception("engine loop failed")
            with self._lock:
                self._thread, calls = None, _take(self._calls)
            loop.call_soon_threadsafe(self._fail_all, err, [done for _, done in calls])

    def _step_while_busy(self, loop: asyncio.AbstractEventLoop) -> None:
        """Apply what was handed over, step, post the outputs; return when nothing is left."""
        while True:
            self._wake.clear()  # before taking what was handed over: a later hand-over sets it
            aborted, calls = self._apply_handed_over(loop)
            if aborted:
                loop.call_soon_threadsafe(self._sink.deliver, aborted)
            for name, done in calls:
                loop.call_soon_threadsafe(_settle, done, *_outcome(getattr(self.engine, name)))
            if not self.engine.has_unfinished():
                if self._tending() and (tend_again_s := self.engine.tend_tiers()) is not None:
                    self._wake.wait(tend_again_s)
                    continue
                if self._idle():
                    return
            outputs = self.engine.step()
            if outputs:
                loop.call_soon_threadsafe(self._sink.deliver, outputs)

    def _apply_handed_over(
        self, loop: asyncio.AbstractEventLoop
    ) -> tuple[list[RequestOutput], list[tuple[CallName, asyncio.Future[Any]]]]:
        """Enqueue new requests (one the engine refuses fails its stream) and end aborted ones
        (their last outputs returned) between two steps; the calls asked for meanwhile."""
        with self._lock:
            pending, aborts, calls = _take(self._pending), _take(self._aborts), _take(self._calls)
        for request in pending:
            try:
                self.engine.add_request(request.prompt_token_ids, request.params, request.request_id,
                                        request.arrival_time)
            except ValueError as err:
                loop.call_soon_threadsafe(self._sink.fail, request.request_id, err)
        ended = [self.engine.abort(request_id) for request_id in aborts]
        return [out for out in ended if out is not None], calls

    def _tending(self) -> bool:
        """Whether to go on tending the tiers with no request (not while `drained` waits)."""
        with self._lock:
            return not self._stop_tending

    def _idle(self) -> bool:
        """Stop the thread if nothing was handed over since the last look (under the lock, so
        a request handed over after this starts a new thread)."""
        with self._lock:
            if self._pending or self._aborts or self._calls:
                return False
            self._thread = None
            return True

    def _fail_all(self, err: Exception, calls: list[asyncio.Future[Any]]) -> None:
        self._sink.fail(None, err)
        for done in calls:
            if not done.done():
                done.set_exception(err)


def _take(items: list) -> list:
    taken = items[:]
    items.clear()
    return taken


def _outcome(method: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """What calling `method` returned, or the exception it raised."""
    try:
        return method(), None
    except Exception as err:
        return None, err


def _settle(done: asyncio.Future[Any], value: Any, err: BaseException | None) -> None:
    if done.done():  # its caller may have been cancelled meanwhile
        return
    if err is not None:
        done.set_exception(err)
    else:
        done.set_result(value)
