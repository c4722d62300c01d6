"""`AsyncLLM`: the engine behind an asyncio API, with streaming and abort.

One asyncio task runs the engine loop. Each `step()` (the forward pass) runs in a worker
thread so the event loop keeps serving; requests added or aborted meanwhile are applied
between steps, so only the loop task ever changes the engine.

    allm = AsyncLLM(model="tiny-llama")
    async for out in allm.generate_stream([1, 2, 3], SamplingParams(max_tokens=8)):
        print(out.token_ids)          # all tokens so far; leaving the loop early aborts
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from tieredkv.config import EngineConfig
from tieredkv.engine import LLMEngine, Prompt
from tieredkv.outputs import RequestOutput
from tieredkv.sampling import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Streaming, concurrent front end of `LLMEngine`; takes the same keywords as `LLM`."""

    def __init__(self, model: str = "tiny-llama", config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(config or EngineConfig.from_kwargs(model=model, **kwargs))
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending: list = []
        self._aborts: list[str] = []
        self._loop_task: asyncio.Task | None = None

    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every new token; the last one has `finished`.
        Raises ValueError at once for a request that can never run."""
        seq = self.engine.make_sequence(prompt, params, request_id)
        if seq.request_id in self._streams:
            raise ValueError(f"request_id: {seq.request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[seq.request_id] = queue
        self._pending.append(seq)
        self._start_loop()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(seq.request_id, None)
            if not finished:  # the caller left early or was cancelled
                self.abort(seq.request_id)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestOutput:
        """The finished output of one request."""
        last = None
        async for out in self.generate_stream(prompt, params):
            last = out
        assert last is not None, "a stream ends with a finished output"
        return last

    def abort(self, request_id: str) -> None:
        """Stop a request; everything it holds in every tier is freed before the next step."""
        self._aborts.append(request_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def close(self) -> None:
        """Abort what is still running, stop the loop and release the tiers."""
        for request_id in list(self._streams):
            self.abort(request_id)
        if self._loop_task is not None:
            await self._loop_task
        self.engine.close()

    def _start_loop(self) -> None:
        """The loop task runs while there is work; a new request starts it again."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _apply_requests(self) -> None:
        for seq in self._pending:
            self.engine.enqueue(seq)
        self._pending.clear()
        for request_id in self._aborts:
            self.engine.abort(request_id)
        self._aborts.clear()

    async def _run(self) -> None:
        try:
            while True:
                self._apply_requests()
                if not self.engine.has_unfinished():
                    return
                outputs = await asyncio.to_thread(self.engine.step)
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as err:  # the engine broke: every waiting stream gets the error
            logger.exception("engine loop failed")
            for queue in self._streams.values():
                queue.put_nowait(err)
            raise
