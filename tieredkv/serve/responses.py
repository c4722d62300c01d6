"""Engine outputs as OpenAI response objects: choices, stream chunks, logprobs, usage.

Operations:
- `Job`: one API request as the engine runs it (one engine request per prompt, `n` choices each:
  choice `i * n + j` is sample j of prompt i, as vLLM numbers them).
- `Cursor.advance(completion)`: what a choice gained since the last call (tokens, text,
  logprobs), or None; a fresh cursor gives the whole choice.
- `choice(job, index, delta)` / `chunk(job, index, delta)`: a choice of the whole response, or
  the stream chunk carrying a delta.
- `usage(prompts, outputs)`: token counts, with the prompt tokens found in the prefix cache (any
  tier) as `prompt_tokens_details.cached_tokens`.

Without a tokenizer a token's text is "token_id:N" (vLLM's `return_tokens_as_token_ids`), so a
choice's text is its ids in that form, and each choice also carries `token_ids`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tieredkv.logprobs import TokenLogprobs
from tieredkv.outputs import CompletionOutput, RequestOutput
from tieredkv.sampling import SamplingParams

Kind = Literal["completion", "chat"]


def id_text(token_id: int) -> str:
    """A token as text where there is no tokenizer (or the client asked for ids)."""
    return f"token_id:{token_id}"


@dataclass
class Job:
    """One API request as the engine runs it. `token_text`: a token's text (None: no tokenizer);
    `echo`: each prompt's text, sent before its choices' text; `token_ids`: choices carry their
    generated ids; `ids_as_tokens`: logprob tokens as "token_id:N"; `continuous_usage`: each stream
    chunk carries its prompt's token counts so far."""

    kind: Kind
    id: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    include_usage: bool
    token_text: Callable[[int], str] | None = None
    echo: list[str] | None = None
    token_ids: bool = False
    ids_as_tokens: bool = False
    continuous_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)

    @property
    def n(self) -> int:
        return self.params[0].n

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def logprob_token(self, token_id: int, decoded: str | None) -> str:
        return id_text(token_id) if self.ids_as_tokens or decoded is None else decoded


@dataclass(frozen=True)
class Delta:
    """What a choice gained: its new tokens, their text and logprobs, and its finish reason once
    it ended. `first`: the choice's first delta; `offset`: the text offset of its first token."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    first: bool
    offset: int


@dataclass
class Cursor:
    """What one choice has handed out so far."""

    tokens: int = 0
    chars: int = 0
    offset: int = 0  # text offset of the next token (the sum of its tokens' lengths)
    started: bool = False
    finished: bool = False

    def advance(self, job: Job, out: CompletionOutput) -> Delta | None:
        """The choice's news in `out` (all of it on a fresh cursor), or None if it has none."""
        ids = out.token_ids[self.tokens:]
        ended = out.finish_reason is not None and not self.finished
        if not ids and not ended:
            return None
        if out.text is not None:
            text = out.text[self.chars:]
        else:
            text = "".join(map(id_text, ids))
        logprobs = None if out.logprobs is None else out.logprobs[self.tokens:self.tokens + len(ids)]
        delta = Delta(ids, text, logprobs, out.finish_reason, not self.started, self.offset)
        self.tokens += len(ids)
        self.chars += len(text)
        if logprobs is not None:
            self.offset += sum(len(job.logprob_token(t, e[t].decoded_token)) for t, e in zip(ids, logprobs,
                                                                                              strict=True))
        self.started, self.finished = True, out.finish_reason is not None
        return delta


def choice(job: Job, index: int, delta: Delta, prompt: int) -> dict[str, Any]:
    """A choice of the whole response (`delta` from a fresh cursor); `prompt`: its prompt's index."""
    text = (job.echo[prompt] if job.echo is not None else "") + delta.text
    body: dict[str, Any] = {"index": index}
    if job.kind == "completion":
        body["text"] = text
    else:
        body["message"] = {"role": "assistant", "content": text}
    body["logprobs"] = _logprobs(job, delta)
    body["finish_reason"] = delta.finish_reason
    if job.token_ids:
        body["token_ids"] = delta.token_ids
    return body


def chunk(job: Job, index: int, delta: Delta, prompt: int) -> dict[str, Any]:
    """The stream chunk of one choice's delta (a choice's first chunk echoes its prompt, and in
    chat says the role)."""
    text = (job.echo[prompt] if job.echo is not None and delta.first else "") + delta.text
    body: dict[str, Any] = {"index": index}
    if job.kind == "completion":
        body["text"] = text
    else:
        body["delta"] = {"role": "assistant", "content": text} if delta.first else {"content": text}
    body["logprobs"] = _logprobs(job, delta)
    body["finish_reason"] = delta.finish_reason
    if job.token_ids:
        body["token_ids"] = delta.token_ids
    obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": [body]}


def _logprobs(job: Job, delta: Delta) -> dict[str, Any] | None:
    if delta.logprobs is None:
        return None
    k = job.params[0].logprobs or 0
    if job.kind == "chat":
        return {"content": [_chat_entry(job, t, e, k) for t, e in zip(delta.token_ids, delta.logprobs, strict=True)]}
    tokens, offsets, offset = [], [], delta.offset
    for t, e in zip(delta.token_ids, delta.logprobs, strict=True):
        tokens.append(job.logprob_token(t, e[t].decoded_token))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e[t].logprob for t, e in zip(delta.token_ids, delta.logprobs, strict=True)],
        "top_logprobs": [_top_by_text(job, e, k) for e in delta.logprobs],
        "text_offset": offsets,
    }


def _top_by_text(job: Job, entry: TokenLogprobs, k: int) -> dict[str, float]:
    """The top `k` of a position keyed by text (two tokens of one text: the likelier one's)."""
    top: dict[str, float] = {}
    for i, p in list(entry.items())[:k]:
        top.setdefault(job.logprob_token(i, p.decoded_token), p.logprob)
    return top


def _chat_entry(job: Job, token_id: int, entry: TokenLogprobs, k: int) -> dict[str, Any]:
    """One position of chat logprobs: the sampled token, then the top `k` (the first `k` of the
    entry: `token_logprobs` puts the top tokens first, in rank order)."""

    def one(i: int) -> dict[str, Any]:
        token = job.logprob_token(i, entry[i].decoded_token)
        return {"token": token, "logprob": entry[i].logprob, "bytes": list(token.encode("utf-8"))}

    return {**one(token_id), "top_logprobs": [one(i) for i in list(entry)[:k]]}


def usage(prompts: list[list[int]], outputs: list[RequestOutput | None]) -> dict[str, Any]:
    """Token counts of `prompts` and their `outputs` so far; `cached_tokens`: prompt tokens found
    in the prefix cache (any tier) when each prompt was first admitted."""
    prompt = sum(map(len, prompts))
    completion = sum(len(c.token_ids) for f in outputs if f is not None for c in f.outputs)
    cached = sum(f.metrics.num_cached_tokens for f in outputs if f is not None and f.metrics is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
