"""`AsyncLLM`: the engine behind an asyncio API, with streaming and abort.

The engine loop runs in a thread of its own, step after step while there is work, so it never
waits for the event loop between two steps (a web server's event loop is busy sending tokens).
Only that thread changes the engine: requests added or aborted, and prefix-cache resets, are
handed to it under a lock and applied between steps. Each step's outputs go back to the event
loop in one batch (`call_soon_threadsafe`), where they are routed to their streams; the
streams' state belongs to the event loop alone.

Operations:
- `generate_stream(prompt, params, request_id)`: stream a request's outputs; leaving early aborts.
- `generate(prompt, params)`: the finished output of one request.
- `abort(request_id)`: end a request; its stream gets a last output with `finish_reason="abort"`.
- `reset_prefix_cache()`: drop the GPU and CPU prefix caches between two steps.
- `drained()`: wait until the engine has no work left (every request finished or aborted).
- `close()`: abort what is open (each stream ends the same way), stop the loop, release the tiers.

A caller's `request_id` names one open stream at a time. Inside the engine every submission gets
an id of its own (`<request_id>#<n>`), and outputs are routed by it: a request cancelled and
retried under the same id never sees, or steals, the other one's tokens.

    allm = AsyncLLM(model="tiny-llama")
    async for out in allm.generate_stream([1, 2, 3], SamplingParams(max_tokens=8)):
        print(out.token_ids)          # all tokens so far; leaving the loop early aborts
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from tieredkv.config import EngineConfig
from tieredkv.engine import LLMEngine, Prompt
from tieredkv.outputs import RequestOutput
from tieredkv.sampling import SamplingParams
from tieredkv.sequence import Sequence as Seq

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Stream:
    """One submitted request: the caller's id, the engine's sequence (under an id of its own)
    and the queue its consumer reads."""

    request_id: str
    seq: Seq
    queue: asyncio.Queue[RequestOutput | BaseException] = dataclasses.field(default_factory=asyncio.Queue)
    aborted: bool = False  # its abort was handed to the engine thread


class AsyncLLM:
    """Streaming, concurrent front end of `LLMEngine`; takes the same keywords as `LLM`."""

    def __init__(self, model: str = "tiny-llama", config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(config or EngineConfig.from_kwargs(model=model, **kwargs))
        # the event loop's: streams and their sequences
        self._open: dict[str, _Stream] = {}  # by the caller's id: streams a consumer reads
        self._live: dict[str, _Stream] = {}  # by the engine's id: sequences not yet released
        self._ids = itertools.count()
        self._closed = False
        # handed from the event loop to the engine thread, under `_lock`
        self._lock = threading.Lock()
        self._pending: list[Seq] = []
        self._aborts: list[Seq] = []
        self._resets: list[asyncio.Future[int]] = []
        self._thread: threading.Thread | None = None  # alive while the engine has work
        self._stopped: asyncio.Future[None] | None = None  # resolved when that thread ends
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every new token; the last one has `finished`
        (`finish_reason="abort"` if `abort()` or `close()` ended it). Raises ValueError at once
        for a request that can never run or a `request_id` another open stream uses."""
        stream = self._submit(prompt, params, request_id)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._open.get(stream.request_id) is stream:
                del self._open[stream.request_id]
            if not finished:  # the caller left early or was cancelled
                self._abort(stream)

    def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> _Stream:
        if self._closed:
            raise RuntimeError("AsyncLLM is closed; create a new one to generate")
        n = next(self._ids)
        request_id = request_id if request_id is not None else f"req-{n}"
        if request_id in self._open:
            raise ValueError(f"request_id: {request_id!r} is already in use by an open stream")
        seq = self.engine.make_sequence(prompt, params, f"{request_id}#{n}")
        stream = _Stream(request_id, seq)
        self._open[request_id] = stream
        self._live[seq.request_id] = stream
        self._hand_over(self._pending, seq)
        return stream

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """The finished output of one request."""
        last = None
        async for out in self.generate_stream(prompt, params):
            last = out
        assert last is not None, "a stream ends with a finished output"
        return last

    def abort(self, request_id: str) -> None:
        """Stop a request; everything it holds in every tier is freed before the next step, and
        its stream ends with an output whose `finish_reason` is "abort". Unknown ids are ignored."""
        stream = self._open.get(request_id)
        if stream is not None:
            self._abort(stream)

    def _abort(self, stream: _Stream) -> None:
        if stream.seq.request_id in self._live and not stream.aborted:
            stream.aborted = True
            self._hand_over(self._aborts, stream.seq)

    async def reset_prefix_cache(self) -> int:
        """Drop the GPU and CPU prefix caches (not the NVMe store) between two steps; how many
        blocks were dropped."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._hand_over(self._resets, done)
        return await done

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def close(self) -> None:
        """Abort what is still running (each open stream ends with an "abort" output), stop the
        loop and release the tiers. Later calls to `generate_stream` raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        for stream in list(self._live.values()):
            self._abort(stream)
        await self.drained()  # a loop that failed has handed its error to every stream and logged it
        self.engine.close()

    async def drained(self) -> None:
        """Return once the engine thread has stopped: every request handed over so far has
        finished or been aborted (or the engine failed)."""
        while True:
            with self._lock:
                stopped = self._stopped
            if stopped is None:
                return
            await stopped
            with self._lock:
                if self._stopped is stopped:  # no thread started since
                    return

    # ------------------------------------------------------------------ the engine thread

    def _hand_over(self, queue: list, item: object) -> None:
        """Give the engine thread a request, an abort or a reset; start the thread if it is
        not running (it stops when the engine runs out of work)."""
        with self._lock:
            queue.append(item)
            if self._thread is None:
                self._loop = asyncio.get_running_loop()
                self._stopped = self._loop.create_future()
                self._thread = threading.Thread(target=self._run, name="tieredkv-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        """Step while there is work; each step's outputs go to the event loop in one batch."""
        loop, stopped = self._loop, self._stopped  # this thread's: a later thread gets new ones
        assert loop is not None and stopped is not None, "started by _hand_over"
        try:
            self._step_while_busy(loop)
        except Exception as err:  # the engine broke: every waiting stream gets the error
            if loop.is_closed():  # nobody is left to deliver to (the event loop ended with requests open)
                with self._lock:
                    self._thread = None
                return
            logger.exception("engine loop failed")
            with self._lock:
                self._thread, resets = None, self._take(self._resets)
            loop.call_soon_threadsafe(self._fail_all, err, resets)
        if not loop.is_closed():
            loop.call_soon_threadsafe(stopped.set_result, None)

    def _step_while_busy(self, loop: asyncio.AbstractEventLoop) -> None:
        """Apply what was handed over, step, post the outputs; return when nothing is left."""
        while True:
            aborted, resets = self._apply_handed_over()
            if aborted:
                loop.call_soon_threadsafe(self._deliver_all, aborted)
            if resets:
                loop.call_soon_threadsafe(self._settle_resets, resets, self.engine.reset_prefix_cache())
            if not self.engine.has_unfinished() and self._idle():
                return
            outputs = self.engine.step()
            if outputs:
                loop.call_soon_threadsafe(self._deliver_all, outputs)

    def _apply_handed_over(self) -> tuple[list[RequestOutput], list[asyncio.Future[int]]]:
        """Enqueue new requests and end aborted ones (their last outputs returned) between two
        steps; the resets asked for meanwhile."""
        with self._lock:
            pending, aborts, resets = self._take(self._pending), self._take(self._aborts), self._take(self._resets)
        for seq in pending:
            self.engine.enqueue(seq)
        ended = [self.engine.abort(seq.request_id) for seq in aborts]
        return [out for out in ended if out is not None], resets

    def _idle(self) -> bool:
        """Stop the thread if nothing was handed over since the last look (under the lock, so
        a request handed over after this starts a new thread)."""
        with self._lock:
            if self._pending or self._aborts or self._resets:
                return False
            self._thread = None
            return True

    @staticmethod
    def _take(items: list) -> list:
        taken = items[:]
        items.clear()
        return taken

    # ------------------------------------------------------------------ on the event loop

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        """Hand an engine output to the stream of the sequence it belongs to, under the
        caller's request id."""
        stream = self._live.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._live[out.request_id]
        stream.queue.put_nowait(dataclasses.replace(out, request_id=stream.request_id))

    @staticmethod
    def _settle_resets(resets: list[asyncio.Future[int]], dropped: int) -> None:
        for done in resets:
            if not done.done():  # its caller may have been cancelled meanwhile
                done.set_result(dropped)

    def _fail_all(self, err: Exception, resets: list[asyncio.Future[int]]) -> None:
        for stream in self._live.values():
            stream.queue.put_nowait(err)
        for done in resets:
            if not done.done():
                done.set_exception(err)
