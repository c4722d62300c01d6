"""Request bodies of the OpenAI-compatible API, and how they become `SamplingParams`.

Operations:
- `CompletionRequest`, `ChatCompletionRequest`, `TokenizeRequest`, `DetokenizeRequest`:
  validated bodies (unknown fields are ignored, as vLLM does).
- `sampling_params(request, max_tokens)`: the engine's parameters, or `BadRequest`.
- `BadRequest(param, message)` / `error_body(...)`: the OpenAI error object a 400 carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt

from tieredkv.sampling import SamplingParams

TokenIds = list[StrictInt]
# fields clients send at their neutral value (vllm bench sends repetition_penalty: 1.0)
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "best_of": 1}


class BadRequest(Exception):
    """A request the server refuses with 400; `param` names the field at fault."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """The error object of OpenAI's API (and vLLM's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    best_of: int | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: a prompt is a string, a list of token ids, or a list of either."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt in the body."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise BadRequest("prompt", "prompt: is empty; give a string or a list of token ids")
        return list(p)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`: messages through the tokenizer's chat template."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        """The messages with their content as plain text (list content: its text parts)."""
        out = []
        for i, message in enumerate(self.messages):
            content = message.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise BadRequest("messages", f"messages[{i}].content: only text parts are supported")
                content = "".join(str(p.get("text", "")) for p in content)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise BadRequest("messages", f"messages[{i}].content: expected a string or a list of text parts")
            out.append({**message, "content": content})
        return out


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a prompt, or chat messages."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: TokenIds


def validation_error(errors: Sequence[Mapping[str, Any]]) -> BadRequest:
    """The first field body validation (pydantic's error list) found fault with, and the most
    specific of its errors ("prompt[1]: Input should be a valid integer", not "a valid string")."""
    fields = [[x for x in e["loc"] if x != "body"] for e in errors]
    param = str(fields[0][0]) if fields[0] else None
    _, first = max(((len(f), e) for f, e in zip(fields, errors, strict=True) if f and str(f[0]) == param),
                   key=lambda pair: pair[0], default=(0, errors[0]))
    where = param or "body"
    for part in first["loc"][2:]:  # type tags of a union ("list[int]") are not places
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if part.isidentifier() else ""
    message = f"{where}: {first['msg']}"
    if param == "prompt":
        message = f"prompt: expected a string, a list of token ids (integers), or a list of either; {message}"
    return BadRequest(param, message)


def unsupported(request: SamplingFields) -> None:
    """Refuse, naming the field, what the engine cannot do yet (rather than ignore it)."""
    if request.n != 1:
        raise BadRequest("n", f"n: only n=1 is supported yet, got {request.n}")
    for name, neutral in NEUTRAL.items():
        value = getattr(request, name)
        if value is not None and value != neutral:
            raise BadRequest(name, f"{name}: not supported yet (only {neutral} is accepted), got {value}")
    logprobs = getattr(request, "logprobs", None)
    if logprobs not in (None, False) or getattr(request, "top_logprobs", None):
        raise BadRequest("logprobs", "logprobs: not supported yet")
    if getattr(request, "echo", False) or getattr(request, "suffix", None):
        raise BadRequest("echo" if request.echo else "suffix", "echo / suffix: not supported yet")


def sampling_params(request: SamplingFields, max_tokens: int) -> SamplingParams:
    """The engine's parameters for `request` (OpenAI's defaults where it says nothing)."""
    unsupported(request)
    top_k = None if request.top_k in (None, -1, 0) else request.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=request.stop or (),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            skip_special_tokens=request.skip_special_tokens,
        )
    except ValueError as err:
        raise BadRequest(param_of(str(err)), str(err)) from None


def param_of(message: str) -> str | None:
    """The field an engine error names ("max_tokens: expected ..." -> "max_tokens")."""
    head = message.split(":", 1)[0]
    return head if head.isidentifier() else None

