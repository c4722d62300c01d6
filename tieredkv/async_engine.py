"""`AsyncLLM`: the engine behind an asyncio API, with streaming and abort.

The engine loop runs step after step while there is work, so it never waits for the event loop
between two steps (a web server's event loop is busy sending tokens): in a thread of its own
(`engine_core.thread`), or with `engine_process=True` in a process of its own
(`engine_core.process`), where a busy server does not even hold the GIL the engine needs. Each
step's outputs come back to the event loop in one batch, where they are routed to their
streams; the streams' state belongs to the event loop alone.

Requests are tokenized and checked against the engine's limits (`info.limits`) here, before
they are handed over, so a request that can never run raises ValueError at once in both modes.

Operations:
- `generate_stream(prompt, params, request_id)`: stream a request's outputs; leaving early aborts.
- `generate(prompt, params)`: the finished output of one request.
- `abort(request_id)`: end a request; its stream gets a last output with `finish_reason="abort"`.
- `reset_prefix_cache()`: drop the GPU and CPU prefix caches between two steps.
- `trace_cpu_tier()`, then `cpu_tier_replay()`: the CPU tier's trace replayed under every policy
  (before `close`).
- `drained()`: wait until the engine has no work left (every request finished or aborted).
- `close()`: abort what is open (each stream ends the same way), stop the loop, release the tiers.
- `stats()`: the engine's counters (from any thread); `healthy`: False once an engine process died.
- `tokenize(prompt)`, `check_request(prompt, params)`, `decode_token(id)`: the engine's checks
  and its tokenizer, for a server validating a request before it answers.

A consumer that falls far behind its stream holds at most `MAX_UNREAD_OUTPUTS` unread outputs,
not one a token (`Mailbox`: outputs are cumulative, so the newest stands for those it
replaces): a client that stops reading does not make its stream's memory grow with the square
of its length.

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
import time
from collections import deque
from collections.abc import AsyncIterator, Hashable
from typing import Any

from tieredkv.config import EngineConfig, api_config
from tieredkv.engine import LLMEngine, Prompt
from tieredkv.engine_core import NewRequest
from tieredkv.engine_core.info import EngineInfo
from tieredkv.engine_core.process import ProcessCore
from tieredkv.engine_core.thread import ThreadCore
from tieredkv.model.runner import load_tokenizer
from tieredkv.outputs import RequestOutput, later_output
from tieredkv.prompts import token_ids
from tieredkv.sampling import SamplingParams
from tieredkv.values import check_request_id

MAX_UNREAD_OUTPUTS = 64  # a stream's outputs a consumer may leave unread before they are joined


class Mailbox:
    """What one or more streams (by `key`) delivered and their consumer has not read, in the
    order it came (the event loop's alone). Once `MAX_UNREAD_OUTPUTS` of a stream's outputs wait,
    its newest one is replaced by the next, which holds all of it (`later_output`); anything
    else (an error, an end) waits in line as it came."""

    def __init__(self) -> None:
        self._order: deque[list[Any]] = deque()  # [key, item], oldest first
        self._newest: dict[Hashable, list[Any]] = {}  # a stream's newest unread output, its entry in `_order`
        self._unread: dict[Hashable, int] = {}  # a stream's unread outputs
        self._arrived = asyncio.Event()

    def put(self, item: object, key: Hashable = None) -> None:
        if not isinstance(item, RequestOutput):
            self._order.append([key, item])
        elif self._unread.get(key, 0) >= MAX_UNREAD_OUTPUTS:
            newest = self._newest[key]
            newest[1] = later_output(newest[1], item)
        else:
            self._newest[key] = [key, item]
            self._order.append(self._newest[key])
            self._unread[key] = self._unread.get(key, 0) + 1
        self._arrived.set()

    async def get(self) -> tuple[Hashable, object]:
        """The oldest unread item, and its key."""
        while not self._order:
            self._arrived.clear()
            await self._arrived.wait()
        entry = self._order.popleft()
        key, item = entry
        if isinstance(item, RequestOutput):
            self._unread[key] -= 1
            if self._newest[key] is entry:
                del self._newest[key], self._unread[key]
        return key, item


@dataclasses.dataclass(eq=False)
class _Stream:
    """One submitted request: the caller's id, the engine's id for it, and the mailbox its
    consumer reads."""

    request_id: str
    engine_id: str
    mailbox: Mailbox = dataclasses.field(default_factory=Mailbox)
    aborted: bool = False  # its abort was handed to the engine loop


class _Streams:
    """The open streams and the engine outputs routed to them (the event loop's alone)."""

    def __init__(self) -> None:
        self.open: dict[str, _Stream] = {}  # by the caller's id: streams a consumer reads
        self.live: dict[str, _Stream] = {}  # by the engine's id: requests the engine may still hold

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand engine outputs to their streams, under the callers' request ids."""
        for out in outputs:
            stream = self.live.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self.live[out.request_id]
            stream.mailbox.put(dataclasses.replace(out, request_id=stream.request_id))

    def fail(self, request_id: str | None, err: BaseException) -> None:
        """End one request's stream with `err` (the engine refused it: it holds nothing), or
        every live one's (None: their aborts still go to the engine)."""
        if request_id is not None:
            stream = self.live.pop(request_id, None)
            if stream is not None:
                stream.mailbox.put(err)
            return
        for stream in self.live.values():
            stream.mailbox.put(err)


class AsyncLLM:
    """Streaming, concurrent front end of `LLMEngine`; takes the same keywords as `LLM`. With
    `engine_process=True` the engine runs in a process of its own (what `tieredkv serve` does)."""

    def __init__(self, model: str = "tiny-llama", config: EngineConfig | None = None, engine_process: bool = False,
                 **kwargs: Any) -> None:
        config = api_config(model, config, kwargs)
        self._streams = _Streams()
        self._core: ThreadCore | ProcessCore
        if engine_process:
            self._core = ProcessCore(config, self._streams)
            self.info: EngineInfo = self._core.info
            try:
                self.tokenizer = load_tokenizer(self.info.config.model.model)
            except BaseException:
                self._core.stop()
                raise
        else:
            engine = LLMEngine(config)
            self._core = ThreadCore(engine, self._streams)
            self.info, self.tokenizer = EngineInfo.of(engine), engine.tokenizer
        self._ids = itertools.count()
        self._closed = False

    @property
    def engine(self) -> LLMEngine:
        """The engine, when it runs in this process (AttributeError with `engine_process=True`).
        It may be replaced before the first request (a subclass that instruments `step`)."""
        if not isinstance(self._core, ThreadCore):
            raise AttributeError("AsyncLLM(engine_process=True) runs the engine in a process of its own; "
                                 "read `info`, call `stats()`")
        return self._core.engine

    @engine.setter
    def engine(self, engine: LLMEngine) -> None:
        assert isinstance(self._core, ThreadCore), "only an engine in this process can be replaced"
        self._core.engine = engine

    @property
    def engine_process(self) -> bool:
        """Whether the engine runs in a process of its own."""
        return isinstance(self._core, ProcessCore)

    @property
    def healthy(self) -> bool:
        """Whether the engine takes requests: False once its process has died."""
        return self._core.healthy

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, as the engine takes them (ValueError saying what to fix)."""
        return token_ids(prompt, self.tokenizer, self.info.limits.vocab_size, add_special_tokens)

    def check_request(self, prompt: Prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the parameters, or the ValueError the engine would raise."""
        params = self.info.limits.check_params(params)
        ids = self.tokenize(prompt)
        self.info.limits.check_sampling(len(ids), params)
        return ids, params

    def decode_token(self, token_id: int) -> str:
        """One token's text (needs a tokenizer)."""
        return self.tokenizer.decode([token_id])

    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every new token (a consumer `MAX_UNREAD_OUTPUTS` behind
        gets the newest, which holds all the tokens so far; its `text_delta` joins those it stands
        for); the last one has `finished` (`finish_reason="abort"` if `abort()` or `close()` ended it). Raises
        ValueError at once for a request that can never run or a `request_id` another open
        stream uses."""
        stream = self._submit(prompt, params, request_id)
        finished = False
        try:
            while not finished:
                _, item = await stream.mailbox.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._streams.open.get(stream.request_id) is stream:
                del self._streams.open[stream.request_id]
            if not finished:  # the caller left early or was cancelled
                self._abort(stream)

    def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> _Stream:
        if self._closed:
            raise RuntimeError("AsyncLLM is closed; create a new one to generate")
        arrival_time = time.monotonic()
        if request_id is not None:
            check_request_id(request_id)
        n = next(self._ids)
        request_id = request_id if request_id is not None else f"req-{n}"
        if request_id in self._streams.open:
            raise ValueError(f"request_id: {request_id!r} is already in use by an open stream")
        ids, params = self.check_request(prompt, params)
        stream = _Stream(request_id, f"{request_id}#{n}")
        self._core.add(NewRequest(stream.engine_id, ids, params, arrival_time))
        self._streams.open[request_id] = stream
        self._streams.live[stream.engine_id] = stream
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
        check_request_id(request_id)
        stream = self._streams.open.get(request_id)
        if stream is not None:
            self._abort(stream)

    def _abort(self, stream: _Stream) -> None:
        if stream.engine_id in self._streams.live and not stream.aborted:
            stream.aborted = True
            self._core.abort(stream.engine_id)

    async def reset_prefix_cache(self) -> int:
        """Drop the GPU and CPU prefix caches (not the NVMe store) between two steps; how many
        blocks were dropped."""
        return await self._core.call("reset_prefix_cache")

    async def trace_cpu_tier(self) -> bool:
        """Record from now on what the CPU tier is offered and asked for; False without one."""
        return await self._core.call("trace_cpu_tier")

    async def cpu_tier_replay(self) -> dict[str, Any] | None:
        """The CPU tier's trace since `trace_cpu_tier`, replayed at its size under every replay
        policy (`cache.trace.replay_all`); None if nothing was traced. Ask before `close`."""
        return await self._core.call("cpu_tier_replay")

    def stats(self) -> dict[str, Any]:
        """The engine's `stats()`; callable from any thread (with an engine process it waits
        for the answer, given between two steps: call it off the event loop), and after
        `close` (the closed engine's)."""
        return self._core.stats()

    async def close(self) -> None:
        """Abort what is still running (each open stream ends with an "abort" output), stop the
        loop and release the tiers. Later calls to `generate_stream` raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        for stream in list(self._streams.live.values()):
            self._abort(stream)
        await self._core.close()  # a loop that failed has handed its error to every stream and logged it

    async def drained(self) -> None:
        """Return once the engine has no work left: every request handed over so far has
        finished or been aborted (or the engine failed)."""
        await self._core.drained()
