"""`AsyncLLM`: the engine behind an asyncio API, with streaming and abort.

One asyncio task runs the engine loop. Each `step()` (the forward pass) runs in a worker
thread so the event loop keeps serving; requests added or aborted meanwhile are applied
between steps, so only the loop task ever changes the engine.

Operations:
- `generate_stream(prompt, params, request_id)`: stream a request's outputs; leaving early aborts.
- `generate(prompt, params)`: the finished output of one request.
- `abort(request_id)`: end a request; its stream gets a last output with `finish_reason="abort"`.
- `reset_prefix_cache()`: drop the GPU and CPU prefix caches between two steps.
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


class AsyncLLM:
    """Streaming, concurrent front end of `LLMEngine`; takes the same keywords as `LLM`."""

    def __init__(self, model: str = "tiny-llama", config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(config or EngineConfig.from_kwargs(model=model, **kwargs))
        self._open: dict[str, _Stream] = {}  # by the caller's id: streams a consumer reads
        self._live: dict[str, _Stream] = {}  # by the engine's id: sequences not yet released
        self._pending: list[Seq] = []
        self._aborts: list[Seq] = []
        self._resets: list[asyncio.Future[int]] = []
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._closed = False

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
        self._pending.append(seq)
        self._start_loop()
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
        if stream.seq.request_id in self._live and stream.seq not in self._aborts:
            self._aborts.append(stream.seq)

    async def reset_prefix_cache(self) -> int:
        """Drop the GPU and CPU prefix caches (not the NVMe store) between two steps; how many
        blocks were dropped."""
        if self._loop_task is None or self._loop_task.done():
            return self.engine.reset_prefix_cache()
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._resets.append(done)
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
        if self._live:
            self._start_loop()
        if self._loop_task is not None:
            # a loop that failed has already handed its error to every stream and logged it
            await asyncio.wait([self._loop_task])
        self.engine.close()

    def _start_loop(self) -> None:
        """The loop task runs while there is work; a new request starts it again."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _apply_requests(self) -> None:
        for seq in self._pending:
            self.engine.enqueue(seq)
        self._pending.clear()
        for seq in self._aborts:
            out = self.engine.abort(seq.request_id)
            if out is not None:
                self._deliver(out)
        self._aborts.clear()
        for done in self._resets:
            if not done.done():  # its caller may have been cancelled meanwhile
                done.set_result(self.engine.reset_prefix_cache())
        self._resets.clear()

    def _deliver(self, out: RequestOutput) -> None:
        """Hand an engine output to the stream of the sequence it belongs to, under the
        caller's request id."""
        stream = self._live.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._live[out.request_id]
        stream.queue.put_nowait(dataclasses.replace(out, request_id=stream.request_id))

    async def _run(self) -> None:
        try:
            while True:
                self._apply_requests()
                if not self.engine.has_unfinished():
                    return
                for out in await asyncio.to_thread(self.engine.step):
                    self._deliver(out)
        except Exception as err:  # the engine broke: every waiting stream gets the error
            logger.exception("engine loop failed")
            for stream in self._live.values():
                stream.queue.put_nowait(err)
            for done in self._resets:
                if not done.done():
                    done.set_exception(err)
            self._resets.clear()
            raise
