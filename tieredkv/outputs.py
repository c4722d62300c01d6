"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    """Monotonic-clock timestamps (seconds) of one request."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """A request's generated tokens so far. `text` is their text so far (with a tokenizer) and
    `text_delta` what this output added to it. `error` is set (and `finish_reason == "error"`)
    when the request was rejected or failed while running; the other requests are unaffected."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    text_delta: str | None = None
