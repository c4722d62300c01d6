"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tieredkv.logprobs import TokenLogprobs


@dataclass(frozen=True)
class RequestMetrics:
    """Monotonic-clock timestamps (seconds) of one request."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # seconds of the TTFT by phase (queued, loading, prefill, preempted: they sum to it), once
    # the first token is out
    ttft_split: dict[str, float] | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class CompletionOutput:
    """One sample (or beam) of a request: its generated tokens so far, their text (with a
    tokenizer), why it ended, the sum of its tokens' logprobs and, with
    `SamplingParams(logprobs=k)`, each token's logprobs (the sampled token and the top k).
    `cumulative_logprob` is None when nothing asked for logprobs."""

    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class RequestOutput:
    """A request's generated tokens so far. `text` is their text so far (with a tokenizer) and
    `text_delta` what this output added to it. `error` is set (and `finish_reason == "error"`)
    when the request was rejected or failed while running; the other requests are unaffected.

    `outputs` holds one `CompletionOutput` per sample (`SamplingParams(n=...)`);
    `token_ids`, `text` and `finish_reason` are those of `outputs[0]`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    text_delta: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outputs:  # one sample: its output is the request's
            only = CompletionOutput(0, self.token_ids, self.text, self.finish_reason)
            object.__setattr__(self, "outputs", [only])


def later_output(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` standing for both of a request's outputs (they are cumulative: the later holds
    every token of the earlier), its `text_delta` what the two added."""
    if earlier.text_delta is None:
        return later
    return replace(later, text_delta=earlier.text_delta + (later.text_delta or ""))
