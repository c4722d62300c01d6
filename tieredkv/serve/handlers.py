"""Completions and chat completions over `AsyncLLM`, whole or streamed as server-sent events.

Operations:
- `OpenAIHandlers(allm, model, metrics)`: the server's state.
- `.completion_job(request)` / `.chat_job(request)`: tokenize and validate (`BadRequest`), before
  any byte of the response is sent; a text longer than the longest request's tokens can stand for
  is refused without being tokenized.
- `.respond(job)`: the whole response body; `.stream(job)`: its SSE lines, one chunk per choice
  that got tokens (its text delta, under its index), then a usage chunk (with
  `stream_options.include_usage`), then `[DONE]`.

A client that leaves cancels the task that awaits the engine; `AsyncLLM.generate_stream` then
aborts the request, which frees its blocks in every tier. An engine failure, or an engine request
that ended with an error (its sampler failed), ends the API request with a 500 error object
carrying the engine's message (in the stream: an error event, then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from tieredkv.async_engine import AsyncLLM, Mailbox
from tieredkv.experiment.metrics import RequestRecord
from tieredkv.experiment.prometheus import ServerMetrics
from tieredkv.outputs import RequestOutput
from tieredkv.sampling import SamplingParams
from tieredkv.serve.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    param_of,
    refuse_unsupported,
    sampling_params,
)
from tieredkv.serve.responses import Cursor, Job, choice, chunk, id_text, usage
from tieredkv.text import chars_per_token, chat_ids, chat_text

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class OpenAIHandlers:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, allm: AsyncLLM, model: str, metrics: ServerMetrics) -> None:
        self.allm, self.model, self.metrics = allm, model, metrics
        # the characters the longest request's tokens can stand for: a longer text is refused as
        # it arrives (tokenizing it, to refuse it then, held a worker thread for seconds)
        tokenizer = allm.tokenizer
        self.max_chars = None if tokenizer is None else allm.info.limits.max_request_tokens * chars_per_token(tokenizer)

    # ------------------------------------------------------------------ requests

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise BadRequest("model", f"model: {name!r} is not served here; this server serves {self.model!r}")

    def completion_job(self, request: CompletionRequest) -> Job:
        self.check_model(request.model)
        refuse_unsupported(request)  # once a request, not once a prompt: it logs the fields it ignores
        texts = request.prompts()
        prompts, params = [], []
        for i, text in enumerate(texts):
            try:
                prompts.append(self._tokenize(text, "prompt", request.add_special_tokens))
                params.append(self._params(request, prompts[-1], request.max_tokens, "max_tokens"))
            except BadRequest as err:
                raise err if len(texts) == 1 else _in_batch(err, i) from None
        job = self._job("completion", "cmpl", request, prompts, params)
        if request.echo:
            job.echo = [t if isinstance(t, str) else self._text(ids) for t, ids in zip(texts, prompts, strict=True)]
        return job

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        self.check_model(request.model)
        refuse_unsupported(request)
        options = request.template_options()
        try:
            text = chat_text(self.allm.tokenizer, request.messages, **options)
        except ValueError as err:
            raise BadRequest("messages", str(err)) from None
        ids = chat_ids(self.allm.tokenizer, self._fits(text, "messages"))
        _check_limit(request.max_tokens, "max_tokens")  # a bad value is refused though max_completion_tokens wins
        field_name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = self._params(request, ids, limit, field_name, prompt_field="messages")
        return self._job("chat", "chatcmpl", request, [ids], [params])

    def _job(self, kind: str, prefix: str, request: SamplingFields, prompts: list[list[int]],
             params: list[SamplingParams]) -> Job:
        tokenizer = self.allm.tokenizer
        return Job(kind, f"{prefix}-{uuid.uuid4().hex}", self.model, prompts, params, request.include_usage,
                   token_text=None if tokenizer is None else self.allm.decode_token,
                   token_ids=tokenizer is None or request.return_token_ids,
                   ids_as_tokens=request.return_tokens_as_token_ids, continuous_usage=request.continuous_usage)

    def _text(self, ids: list[int]) -> str:
        """A prompt's text: through the tokenizer, or its ids as "token_id:N"."""
        tokenizer = self.allm.tokenizer
        return "".join(map(id_text, ids)) if tokenizer is None else tokenizer.decode(ids)

    def _tokenize(self, prompt: str | list[int], field_name: str, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            self._fits(prompt, field_name)
        try:
            return self.allm.tokenize(prompt, add_special_tokens)
        except ValueError as err:
            raise BadRequest(field_name, str(err)) from None

    def _fits(self, text: str, field_name: str) -> str:
        """`text`, unless it has more characters than the longest request's tokens can stand for."""
        if self.max_chars is not None and len(text) > self.max_chars:
            longest = self.allm.info.limits.max_request_tokens
            raise BadRequest(field_name, f"{field_name}: {len(text)} characters are more than the maximum length of "
                             f"{longest} tokens can hold (at most {self.max_chars}); shorten it")
        return text

    def _params(self, request: SamplingFields, ids: list[int], limit: int | None, field_name: str,
                prompt_field: str = "prompt") -> SamplingParams:
        """Parameters for one prompt; no limit means all the room the model and the cache leave."""
        _check_limit(limit, field_name)
        longest = self.allm.info.limits.max_request_tokens
        room = longest - len(ids)
        if room < 1:
            raise BadRequest(prompt_field, f"{prompt_field}: {len(ids)} tokens leave no room to generate within "
                             f"the maximum length of {longest} tokens; shorten it")
        if limit is not None and limit > room:
            raise BadRequest(field_name, f"{field_name}: {limit} tokens after a prompt of {len(ids)} exceed the "
                             f"maximum length of {longest} tokens; ask for at most {room}")
        params = sampling_params(request, limit if limit is not None else room)
        if params.stop and self.allm.tokenizer is None:  # the engine has no text to find them in
            raise BadRequest("stop", "stop: stop strings need a tokenizer in the model directory, and this model "
                             "has none; use stop_token_ids")
        try:  # the engine's own checks (length, vocabulary), before the response starts
            self.allm.check_request(ids, params)
        except ValueError as err:
            param = param_of(str(err))
            raise BadRequest(prompt_field if param == "prompt" else param, str(err)) from None
        return params

    # ------------------------------------------------------------------ responses

    async def respond(self, job: Job) -> dict:
        """The whole response; raises what the engine raised."""
        finals: list[RequestOutput | None] = [None] * len(job.prompts)
        async with aclosing(self._outputs(job)) as outputs:
            async for i, out in outputs:
                finals[i] = out
        assert all(f is not None and f.finished for f in finals), "every stream ends with a finished output"
        choices = [choice(job, i * job.n + j, Cursor().advance(job, c), i)
                   for i, out in enumerate(finals) for j, c in enumerate(out.outputs)]
        return {"id": job.id, "object": job.object, "created": job.created, "model": job.model, "choices": choices,
                "usage": usage(job.prompts, finals)}

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE lines: a chunk per choice with news, the usage chunk if asked, `[DONE]`."""
        cursors = [[Cursor() for _ in range(job.n)] for _ in job.prompts]
        finals: list[RequestOutput | None] = [None] * len(job.prompts)
        failed = False
        try:
            async with aclosing(self._outputs(job)) as outputs:
                async for i, out in outputs:
                    for j, c in enumerate(out.outputs):
                        delta = cursors[i][j].advance(job, c)
                        if delta is not None:
                            body = chunk(job, i * job.n + j, delta, i)
                            if job.continuous_usage:  # this prompt's counts so far
                                body["usage"] = usage([job.prompts[i]], [out])
                            yield sse(body)
                    if out.finished:
                        finals[i] = out
        except Exception as err:  # the engine failed: this stream ends with the error
            logger.exception("request %s failed", job.id)
            yield sse(error_body(f"the engine failed: {err}", "InternalServerError", 500))
            failed = True
        if not failed and job.include_usage:
            obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
            yield sse({"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": [],
                       "usage": usage(job.prompts, finals)})
        yield DONE

    async def _outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine produces them, over all the job's prompts; each
        engine request is recorded in the metrics when it ends (or fails, or its client leaves)."""
        records = [RequestRecord(f"{job.id}-{i}", job.arrival, prompt_tokens=len(ids))
                   for i, ids in enumerate(job.prompts)]
        finals: list[RequestOutput | None] = [None] * len(job.prompts)
        streams = [self.allm.generate_stream(ids, p, request_id=record.tag)
                   for ids, p, record in zip(job.prompts, job.params, records, strict=True)]
        merged = _single(streams[0]) if len(streams) == 1 else _merge(streams)
        failed = False
        try:
            async with aclosing(merged):
                async for i, out in merged:
                    records[i].token_times.append(time.monotonic())
                    finals[i] = out
                    if out.error is not None:  # the engine failed this request alone (e.g. its sampler)
                        raise RuntimeError(out.error)
                    yield i, out
        except Exception:
            failed = True
            raise
        finally:
            for record, final in zip(records, finals, strict=True):
                self._observe(record, final, failed)

    def _observe(self, record: RequestRecord, final: RequestOutput | None, failed: bool) -> None:
        """Metrics of one engine request: `final` is its last output (None: it had none)."""
        if final is not None and final.metrics is not None:
            record.cached_tokens = final.metrics.num_cached_tokens
        generated = 0 if final is None else sum(len(c.token_ids) for c in final.outputs)
        reason = "abort" if final is None or not final.finished else final.finish_reason
        self.metrics.observe(self.model, record, generated, None if failed or reason == "error" else reason)


def _check_limit(limit: int | None, field_name: str) -> None:
    """A `BadRequest` unless the token limit `limit` is unset or at least 1."""
    if limit is not None and limit < 1:
        raise BadRequest(field_name, f"{field_name}: expected an integer >= 1, got {limit}")


def _in_batch(err: BadRequest, index: int) -> BadRequest:
    """`err` naming the prompt of a batch it is about ("prompt: ..." -> "prompt[3]: ...")."""
    if err.param != "prompt" or not err.message.startswith("prompt:"):
        return err
    return BadRequest("prompt", f"prompt[{index}]:{err.message.removeprefix('prompt:')}")


async def _single(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with aclosing(stream):
        async for out in stream:
            yield 0, out


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as their items arrive (outputs not sent yet are joined
    past `MAX_UNREAD_OUTPUTS` a stream, as in `AsyncLLM`'s streams); leaving early cancels them
    all (each aborts its request)."""
    mailbox = Mailbox()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                mailbox.put(out, i)
            mailbox.put(None, i)
        except Exception as err:
            mailbox.put(err, i)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await mailbox.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
