"""Request bodies of the OpenAI-compatible API, and how they become `SamplingParams`.

Operations:
- `CompletionRequest`, `ChatCompletionRequest`, `TokenizeRequest`, `DetokenizeRequest`:
  validated bodies, strictly typed (`"5"` or `true` is not a number, `"yes"` or `1` not a
  boolean; an integer is a number). A field of OpenAI's or vLLM's API that the engine does not
  do (`REFUSED`) is a 400 naming it unless it holds its neutral value (of its type: `true` is not
  `1.0`, nor `0` `false`); a field neither API has is ignored with a warning in the server's log
  (as vLLM does). A completion holds at most `MAX_PROMPTS` prompts. A list field's validation
  stops at its first bad item.
- `refuse_unsupported(request)`: a `BadRequest` naming a field the engine does not do.
- `sampling_params(request, max_tokens)`: the engine's parameters, or `BadRequest`.
- `BadRequest(param, message)` / `error_body(...)`: the OpenAI error object a 400 carries.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from tieredkv.sampling import SamplingParams

logger = logging.getLogger(__name__)

# list fields stop at their first bad item (`fail_fast`): pydantic would record an error for every
# bad item in every branch of a union, and a body of millions of them held the event loop a minute
TokenIds = Annotated[list[StrictInt], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]
Batch = Annotated[list[TokenIds], Field(fail_fast=True)]
Messages = Annotated[list[dict[str, Any]], Field(fail_fast=True)]
MAX_LOGPROBS = 20  # top tokens per position, OpenAI's (and vLLM's default) limit
# prompts in one completion request: each is an engine request, validated on arrival and queued
# ahead of later requests, so one body may not hold an unbounded number of them
MAX_PROMPTS = 1024
# fields of OpenAI's and vLLM's APIs the engine does not do, with the values that ask for nothing
# (clients send some of them at their neutral value: vllm bench sends repetition_penalty: 1.0)
REFUSED: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "min_p": (None, 0.0), "logit_bias": (None, {}), "suffix": (None, ""), "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "lora_request": (None,),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "length_penalty": (None, 1.0), "use_beam_search": (None, False), "echo": (None, False),
    "chat_template": (None,),  # the model's own template only: a request's would be code run here
    "add_special_tokens": (None, False),  # in chat: the template places the special tokens itself
}
# the type tags of union branches that read as names (no field has one of them)
UNION_TAGS = frozenset({"str", "int", "float", "bool"})
# fields of the APIs that change nothing the engine computes (bookkeeping, or options of features
# above that are off): accepted without a warning
ACCEPTED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier", "request_id", "priority", "spaces_between_special_tokens",
                      "verbosity"})


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
    """`include_usage`: a last chunk with the token counts; with it, `continuous_usage_stats`
    (vLLM's): every chunk carries its prompt's counts so far."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat share. `return_token_ids` (vLLM's field) adds the
    generated ids to each choice (always there when the model has no tokenizer);
    `return_tokens_as_token_ids` writes logprob tokens as "token_id:N"."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Texts | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    best_of: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def num_logprobs(self) -> int | None:
        """Top tokens per position the response reports (None: no logprobs)."""
        raise NotImplementedError


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: a prompt is a string, a list of token ids, or a list of either;
    `add_special_tokens`: a string prompt is encoded with the tokenizer's special tokens (BOS)."""

    prompt: str | TokenIds | Texts | Batch
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True

    def num_logprobs(self) -> int | None:
        if self.logprobs is not None and self.echo:
            raise BadRequest("echo", "echo: not supported together with logprobs (that needs the prompt's logprobs)")
        return _logprobs_count("logprobs", self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt in the body."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise BadRequest("prompt", "prompt: is empty; give a string or a list of token ids")
        if len(p) > MAX_PROMPTS:
            raise BadRequest("prompt", f"prompt: {len(p)} prompts in one request; send at most {MAX_PROMPTS}")
        return list(p)


class ChatTemplateFields(BaseModel):
    """How chat messages become the prompt (vLLM's fields): the assistant's turn opened after
    them (`add_generation_prompt`), or the last message left open to be continued
    (`continue_final_message`); `chat_template_kwargs`: variables for the model's template
    (e.g. `enable_thinking`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        """`chat_prompt`'s keyword arguments, or `BadRequest`."""
        if self.add_generation_prompt and self.continue_final_message:
            raise BadRequest("continue_final_message", "continue_final_message: true needs "
                             "add_generation_prompt: false (the last message is continued, no new turn opened)")
        kwargs = self.chat_template_kwargs or {}
        taken = sorted(TEMPLATE_ARGUMENTS.intersection(kwargs))
        if taken:
            raise BadRequest("chat_template_kwargs", f"chat_template_kwargs: {', '.join(taken)} are not variables "
                             "of the template; give the request's own fields instead")
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "template_kwargs": kwargs}


# the tokenizer's own arguments of `apply_chat_template`, not the template's variables
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """`POST /v1/chat/completions`: messages through the tokenizer's chat template."""

    messages: Messages
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise BadRequest("top_logprobs", "top_logprobs: needs logprobs: true")
            return None
        return _logprobs_count("top_logprobs", self.top_logprobs or 0)


class TokenizeRequest(ChatTemplateFields):
    """`POST /tokenize`: a prompt, or chat messages with chat's options (its other fields as a
    completion's: `REFUSED` ones are a 400 unless neutral, e.g. `chat_template`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: TokenIds


def validation_error(errors: Sequence[Mapping[str, Any]]) -> BadRequest:
    """The first field body validation (pydantic's error list) found fault with, and the most
    specific of its errors ("prompt[1]: Input should be a valid integer", not "a valid string").
    A body that is not a JSON object is at fault as a whole (no `param`)."""
    body = _body_error(errors[0])
    if body is not None:
        return body
    fields = [[x for x in e["loc"] if x != "body"] for e in errors]
    param = str(fields[0][0]) if fields[0] else None
    _, first = max(((len(f), e) for f, e in zip(fields, errors, strict=True) if f and str(f[0]) == param),
                   key=lambda pair: pair[0], default=(0, errors[0]))
    where = param or "body"
    for part in first["loc"][2:]:  # type tags of a union ("str", "list[int]") are not places
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if _is_place(part) else ""
    message = f"{where}: {first['msg']}"
    if param == "prompt":
        message = f"prompt: expected a string, a list of token ids (integers), or a list of either; {message}"
    return BadRequest(param, message)


def _is_place(part: str) -> bool:
    """Whether a part of an error's location is a field's name, not the type tag pydantic gives a
    branch of a union ("str", "list[int]", "function-after[...]")."""
    return part.isidentifier() and part not in UNION_TAGS


def _body_error(error: Mapping[str, Any]) -> BadRequest | None:
    """The error of a body that is not JSON, or not an object; None for an error of a field."""
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", error["msg"])
        return BadRequest(None, f"body: not valid JSON ({reason} at position {error['loc'][-1]}); send a JSON object")
    if tuple(error["loc"]) == ("body",) and error["type"] == "string_unicode":  # a field's name
        return BadRequest(None, "body: a field name has a lone surrogate; send valid Unicode text")
    if tuple(error["loc"]) == ("body",):
        return BadRequest(None, "body: expected a JSON object, sent with Content-Type: application/json")
    return None


def _logprobs_count(name: str, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(name, f"{name}: expected an integer in [0, {MAX_LOGPROBS}], got {value}")
    return value


def refuse_unsupported(request: BaseModel) -> None:
    """A 400 naming the first field the engine does not do (rather than ignore it); a warning
    for fields neither API has."""
    extra = request.model_extra or {}
    for name, value in extra.items():
        neutral = REFUSED.get(name)
        if neutral is not None and not any(_is_neutral(value, v) for v in neutral):
            raise BadRequest(name, f"{name}: not supported (only {_neutral(neutral)} is accepted), got {value!r}")
    unknown = sorted(k for k in extra if k not in REFUSED and k not in ACCEPTED)
    if unknown:
        logger.warning("ignored fields neither OpenAI's nor vLLM's API has: %s", ", ".join(unknown))


def _is_neutral(value: Any, neutral: Any) -> bool:
    """Whether `value` is `neutral`, of its type too: an integer stands for a float (`1` for
    `1.0`), a boolean never for a number (`true == 1.0` in Python), a number never for a boolean."""
    if isinstance(neutral, float) and type(value) is int:
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def _neutral(values: tuple[Any, ...]) -> str:
    return " or ".join("null" if v is None else repr(v) for v in values)


def sampling_params(request: SamplingFields, max_tokens: int) -> SamplingParams:
    """The engine's parameters for `request` (OpenAI's defaults where it says nothing); its
    fields the engine does not do were refused already (`refuse_unsupported`, once a request)."""
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options", "stream_options: only allowed with stream: true")
    if request.stream and request.best_of is not None and request.best_of > request.n:
        raise BadRequest("best_of", "best_of: not supported with stream (the best samples are known at the end)")
    top_k = None if request.top_k in (None, -1, 0) else request.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=() if request.stop is None else request.stop,  # "" is refused as [""] is
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            skip_special_tokens=request.skip_special_tokens,
            n=request.n,
            best_of=request.best_of,
            logprobs=request.num_logprobs(),
        )
    except ValueError as err:
        raise BadRequest(param_of(str(err)), str(err)) from None


def param_of(message: str) -> str | None:
    """The field an engine error names ("max_tokens: expected ..." -> "max_tokens")."""
    head = message.split(":", 1)[0]
    return head if head.isidentifier() else None

