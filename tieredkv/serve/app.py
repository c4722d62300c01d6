"""The FastAPI application: routes, error objects, Prometheus metrics.

Routes (following vLLM's OpenAI server): `GET /v1/models` (and `GET /v1/models/{id}`, OpenAI's),
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /health`, `GET /metrics`,
`POST /tokenize`, `POST /detokenize`; `HEAD` too where a probe sends it (/health, /v1/models).
A bad request is a 400 with an OpenAI error object whose `param` names the field (a body over
`MAX_BODY_BYTES`: a 413, refused before it is read); an engine failure is a 500 for the requests
it touched, and the server keeps serving. Once an engine process has died, /health and every
generation answer 503. Prompts are tokenized (and /detokenize's tokens decoded) in worker threads,
so a long one does not hold up the streams the event loop sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tieredkv.async_engine import AsyncLLM
from tieredkv.experiment.prometheus import ServerMetrics
from tieredkv.serve.handlers import OpenAIHandlers
from tieredkv.serve.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    refuse_unsupported,
    validation_error,
)
from tieredkv.text import chat_prompt
from tieredkv.values import check_text

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# the largest request body read; a bigger one is refused (413) before it is read or tokenized
MAX_BODY_BYTES = 16 * 2**20


def build_app(allm: AsyncLLM, model: str) -> FastAPI:
    """The server's application over `allm`, serving it under the name `model`; closing the
    application (uvicorn's shutdown) closes the engine."""
    metrics = ServerMetrics()
    handlers = OpenAIHandlers(allm, model, metrics)
    card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "tieredkv",
            "root": allm.info.config.model.model, "parent": None, "max_model_len": allm.info.limits.max_request_tokens}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await allm.close()

    app = FastAPI(title="tieredkv", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    _install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if allm.healthy else 503)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str) -> Response:
        if name != model:
            message = f"model: {name!r} is not served here; this server serves {model!r}"
            return JSONResponse(error_body(message, "NotFoundError", 404, "model"), status_code=404)
        return JSONResponse(card)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await _generate(handlers, await asyncio.to_thread(handlers.completion_job, body), body.stream, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _generate(handlers, await asyncio.to_thread(handlers.chat_job, body), body.stream, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        handlers.check_model(body.model)
        refuse_unsupported(body)
        tokens = await asyncio.to_thread(_tokenize, allm, body)
        return {"count": len(tokens), "max_model_len": allm.info.limits.max_request_tokens, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        handlers.check_model(body.model)
        return {"prompt": await asyncio.to_thread(_detokenize, allm, body.tokens)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if allm.healthy:  # else the server's own series and the engine's last counters
            with contextlib.suppress(RuntimeError, TimeoutError):  # it died while asked
                metrics.update(model, await asyncio.to_thread(allm.stats))  # answered between steps
        text, content_type = metrics.exposition()
        return Response(text, media_type=content_type)

    return app


async def _generate(handlers: OpenAIHandlers, job: Any, stream: bool, raw: Request) -> Response:
    if not handlers.allm.healthy:
        message = "the engine is not running (its process exited); restart the server"
        return JSONResponse(error_body(message, "ServiceUnavailableError", 503), status_code=503)
    if stream:
        return StreamingResponse(handlers.stream(job), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        body = await _unless_disconnected(handlers.respond(job), raw)
    except Exception as err:
        logger.exception("request %s failed", job.id)
        return JSONResponse(error_body(f"the engine failed: {err}", "InternalServerError", 500), status_code=500)
    if body is None:  # the client left; its requests were aborted
        return Response(status_code=499)
    return JSONResponse(body)


async def _unless_disconnected(work: Awaitable[dict[str, Any]], raw: Request) -> dict[str, Any] | None:
    """The result of `work`, or None (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(raw))
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _tokenizer(allm: AsyncLLM, param: str) -> Any:
    tokenizer = allm.tokenizer
    if tokenizer is None:
        raise BadRequest(param, f"{param}: the model directory has no tokenizer")
    return tokenizer


def _tokenize(allm: AsyncLLM, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        options = body.template_options()
        try:
            return chat_prompt(allm.tokenizer, body.messages, **options)
        except ValueError as err:
            raise BadRequest("messages", str(err)) from None
    if body.prompt is None:
        raise BadRequest("prompt", "prompt: give a prompt (or messages) to tokenize")
    tokenizer = _tokenizer(allm, "prompt")
    try:
        return tokenizer.encode(check_text(body.prompt, "prompt"), add_special_tokens=body.add_special_tokens)
    except ValueError as err:
        raise BadRequest("prompt", str(err)) from None


def _detokenize(allm: AsyncLLM, tokens: list[int]) -> str:
    tokenizer = _tokenizer(allm, "tokens")
    if tokens:
        try:
            allm.tokenize(tokens)
        except ValueError as err:
            raise BadRequest("tokens", str(err).replace("prompt:", "tokens:", 1)) from None
    return tokenizer.decode(tokens)


def _install_error_handlers(app: FastAPI) -> None:
    def bad_request(err: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(err.message, "BadRequestError", 400, err.param), status_code=400)

    @app.exception_handler(BadRequest)
    async def on_bad_request(request: Request, err: BadRequest) -> JSONResponse:
        return bad_request(err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        return bad_request(validation_error(err.errors()))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException) -> JSONResponse:
        """Routing errors (404, 405), a body over the limit (413), one that is not JSON (400)."""
        message = err.detail if err.status_code != 400 else f"body: not valid JSON ({err.detail}); send a JSON object"
        kind = http.HTTPStatus(err.status_code).phrase.replace(" ", "") + "Error"
        return JSONResponse(error_body(message, kind, err.status_code), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, err: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(f"the server failed: {err}", "InternalServerError", 500), status_code=500)


class BodyLimit:
    """ASGI middleware refusing a request body over `limit` bytes with 413: at once when its
    Content-Length says so, else as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared.isdigit() and int(declared) > self.limit:
                raise self._too_large(int(declared))
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise self._too_large(received)
            return message

        await self.app(scope, limited, send)

    def _too_large(self, size: int) -> HTTPException:
        return HTTPException(413, f"body: {size} bytes exceed the limit of {self.limit} bytes; "
                                  "send fewer or shorter prompts")
