"""Completions and chat completions over `AsyncLLM`, whole or streamed as server-sent events.

Operations:
- `OpenAIHandlers(allm, model, metrics)`: the server's state.
- `.completion_job(request)` / `.chat_job(request)`: tokenize and validate (`BadRequest`), before
  any byte of the response is sent.
- `.respond(job)`: the whole response body; `.stream(job)`: its SSE lines, one chunk per token
  (its text delta), then a usage chunk (with `stream_options.include_usage`), then `[DONE]`.

A client that leaves cancels the task that awaits the engine; `AsyncLLM.generate_stream` then
aborts the request, which frees its blocks in every tier. An engine failure ends the affected
requests with a 500 error object (in the stream: an error event, then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from tieredkv.async_engine import AsyncLLM
from tieredkv.experiment.prometheus import PrometheusMetrics
from tieredkv.outputs import RequestOutput
from tieredkv.sampling import SamplingParams
from tieredkv.serve.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    param_of,
    sampling_params,
)
from tieredkv.text import chat_prompt

logger = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]
DONE = "data: [DONE]\n\n"


@dataclass
class Job:
    """One API request as the engine runs it: one token-id prompt per choice."""

    kind: Kind
    id: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class Timing:
    """Token times of one choice, for the TTFT / ITL histograms."""

    arrival: float
    times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.arrival if self.times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class OpenAIHandlers:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, allm: AsyncLLM, model: str, metrics: PrometheusMetrics) -> None:
        self.allm, self.model, self.metrics = allm, model, metrics

    # ------------------------------------------------------------------ requests

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise BadRequest("model", f"model: {name!r} is not served here; this server serves {self.model!r}")

    def completion_job(self, request: CompletionRequest) -> Job:
        self.check_model(request.model)
        prompts = [self._tokenize(p, "prompt") for p in request.prompts()]
        params = [self._params(request, ids, request.max_tokens, "max_tokens") for ids in prompts]
        return Job("completion", f"cmpl-{uuid.uuid4().hex}", self.model, prompts, params, request.include_usage)

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        self.check_model(request.model)
        try:
            ids = chat_prompt(self.allm.engine.tokenizer, request.conversation())
        except ValueError as err:
            raise BadRequest("messages", str(err)) from None
        field_name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = self._params(request, ids, limit, field_name, prompt_field="messages")
        return Job("chat", f"chatcmpl-{uuid.uuid4().hex}", self.model, [ids], [params], request.include_usage)

    def _tokenize(self, prompt: str | list[int], field_name: str) -> list[int]:
        try:
            return self.allm.engine.tokenize(prompt)
        except ValueError as err:
            raise BadRequest(field_name, str(err)) from None

    def _params(self, request: SamplingFields, ids: list[int], limit: int | None, field_name: str,
                prompt_field: str = "prompt") -> SamplingParams:
        """Parameters for one prompt; no limit means all the room the model and the cache leave."""
        if limit is not None and limit < 1:
            raise BadRequest(field_name, f"{field_name}: expected an integer >= 1, got {limit}")
        longest = self.allm.engine.max_request_tokens
        room = longest - len(ids)
        if room < 1:
            raise BadRequest(prompt_field, f"{prompt_field}: {len(ids)} tokens leave no room to generate within "
                             f"the maximum length of {longest} tokens; shorten it")
        if limit is not None and limit > room:
            raise BadRequest(field_name, f"{field_name}: {limit} tokens after a prompt of {len(ids)} exceed the "
                             f"maximum length of {longest} tokens; ask for at most {room}")
        params = sampling_params(request, limit if limit is not None else room)
        try:  # the engine's own checks (length, vocabulary), before the response starts
            self.allm.engine.make_sequence(ids, params)
        except ValueError as err:
            param = param_of(str(err))
            raise BadRequest(prompt_field if param == "prompt" else param, str(err)) from None
        return params

    # ------------------------------------------------------------------ responses

    async def respond(self, job: Job) -> dict[str, Any]:
        """The whole response; raises what the engine raised."""
        timings = [Timing(job.arrival) for _ in job.prompts]
        finals: list[RequestOutput | None] = [None] * len(job.prompts)
        outcome = "error"
        try:
            async for i, out in self._outputs(job):
                timings[i].times.append(time.monotonic())
                finals[i] = out
            outcome = "ok"
        except asyncio.CancelledError:
            outcome = "abort"
            raise
        finally:
            self._record(timings, outcome)
        assert all(f is not None and f.finished for f in finals), "every stream ends with a finished output"
        choices = [self._choice(job.kind, i, out) for i, out in enumerate(finals)]
        obj = "text_completion" if job.kind == "completion" else "chat.completion"
        return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": choices,
                "usage": self._usage(job, finals)}

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE lines: one chunk per token of every choice, the usage chunk if asked, `[DONE]`."""
        timings = [Timing(job.arrival) for _ in job.prompts]
        finals: list[RequestOutput | None] = [None] * len(job.prompts)
        outcome = "error"
        try:
            async for i, out in self._outputs(job):
                timings[i].times.append(time.monotonic())
                yield sse(self._chunk(job, i, out, first=len(timings[i].times) == 1))
                if out.finished:
                    finals[i] = out
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):  # the client left
            outcome = "abort"
            raise
        except Exception as err:  # the engine failed: this stream ends with the error
            logger.exception("request %s failed", job.id)
            yield sse(error_body(f"the engine failed: {err}", "InternalServerError", 500))
        finally:
            self._record(timings, outcome)
        if outcome == "ok" and job.include_usage:
            obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
            yield sse({"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": [],
                       "usage": self._usage(job, finals)})
        yield DONE

    async def _outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, over all the job's prompts."""
        streams = [self.allm.generate_stream(ids, p, request_id=f"{job.id}-{i}")
                   for i, (ids, p) in enumerate(zip(job.prompts, job.params, strict=True))]
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        async for item in _merge(streams):
            yield item

    def _chunk(self, job: Job, i: int, out: RequestOutput, first: bool) -> dict[str, Any]:
        delta = out.text_delta or ""
        reason = out.finish_reason if out.finished else None
        if job.kind == "completion":
            choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
            return {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                    "choices": [choice]}
        message = {"role": "assistant", "content": delta} if first else {"content": delta}
        choice = {"index": i, "delta": message, "logprobs": None, "finish_reason": reason}
        return {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
                "choices": [choice]}

    @staticmethod
    def _choice(kind: Kind, i: int, out: RequestOutput) -> dict[str, Any]:
        text = out.text or ""
        if kind == "completion":
            return {"index": i, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
        return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": out.finish_reason}

    @staticmethod
    def _usage(job: Job, finals: list[RequestOutput | None]) -> dict[str, int]:
        prompt = sum(map(len, job.prompts))
        completion = sum(len(f.token_ids) for f in finals if f is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _record(self, timings: list[Timing], outcome: str) -> None:
        for t in timings:
            self.metrics.record(self.model, t.ttft, t.itls, len(t.times), outcome == "error", outcome == "abort")


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as their items arrive; leaving early cancels them all
    (each aborts its request)."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait(None)
        except Exception as err:
            queue.put_nowait(err)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
