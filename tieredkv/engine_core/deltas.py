"""A step's outputs as per-request deltas, and the outputs rebuilt from them.

An engine process sends each output as what it added since the last one (new token ids, their
text and logprobs, per sample) rather than everything so far, so a message stays the size of a
step's news however long the requests grow. The server rebuilds the `RequestOutput` the engine
made, equal field for field.

Operations:
- `DeltaEncoder.encode(output)`: the output's `OutputDelta` (in the engine process).
- `OutputRebuilder(prompt_token_ids).apply(delta)`: the `RequestOutput` (in the server).

Samples are keyed by their `index`: with `best_of` the finished output lists the best `n`
samples, in another order, and a delta says which samples in which order. A sample's tokens,
text and logprobs only grow (text held back for stop strings is never taken back).
"""

from __future__ import annotations

from typing import NamedTuple

from tieredkv.logprobs import TokenLogprobs
from tieredkv.outputs import CompletionOutput, RequestMetrics, RequestOutput


class SampleDelta(NamedTuple):
    """What one sample added: its new tokens, their text (None: no tokenizer) and logprobs
    (None: not asked for); its finish reason and cumulative logprob now."""

    index: int
    token_ids: list[int]
    text: str | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    cumulative_logprob: float | None


class OutputDelta(NamedTuple):
    """One request's news in one step; `metrics` is None when unchanged since the last delta."""

    request_id: str
    finished: bool
    finish_reason: str | None
    error: str | None
    text_delta: str | None
    metrics: RequestMetrics | None
    samples: list[SampleDelta]


class DeltaEncoder:
    """What was sent of each unfinished request: per sample, its tokens and characters; the
    last metrics."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}
        self._metrics: dict[str, RequestMetrics | None] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        """The delta of `out` against what was sent of its request; a finished request is forgotten."""
        sent = self._sent.setdefault(out.request_id, {})
        samples = []
        for c in out.outputs:
            tokens, chars = sent.get(c.index, (0, 0))
            text = None if c.text is None else c.text[chars:]
            logprobs = None if c.logprobs is None else c.logprobs[tokens:]
            samples.append(SampleDelta(c.index, c.token_ids[tokens:], text, logprobs, c.finish_reason,
                                       c.cumulative_logprob))
            sent[c.index] = (len(c.token_ids), chars if c.text is None else len(c.text))
        metrics = out.metrics if out.metrics != self._metrics.get(out.request_id) else None
        if out.finished:
            del self._sent[out.request_id]
            self._metrics.pop(out.request_id, None)
        else:
            self._metrics[out.request_id] = out.metrics
        return OutputDelta(out.request_id, out.finished, out.finish_reason, out.error, out.text_delta, metrics,
                           samples)


class _Sample:
    """A sample rebuilt so far."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: str | None = None
        self.logprobs: list[TokenLogprobs] | None = None

    def apply(self, d: SampleDelta) -> CompletionOutput:
        self.token_ids += d.token_ids
        if d.text is not None:
            self.text = (self.text or "") + d.text
        if d.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs += d.logprobs
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(d.index, list(self.token_ids), self.text, d.finish_reason, d.cumulative_logprob,
                                logprobs)


class OutputRebuilder:
    """One request's outputs, rebuilt from its deltas in order."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self._samples: dict[int, _Sample] = {}
        self._metrics: RequestMetrics | None = None

    def apply(self, d: OutputDelta) -> RequestOutput:
        """The output the engine made, given its delta."""
        outputs = [self._samples.setdefault(s.index, _Sample()).apply(s) for s in d.samples]
        if d.metrics is not None:
            self._metrics = d.metrics
        first = outputs[0] if outputs else CompletionOutput(0, [], None, d.finish_reason)
        return RequestOutput(d.request_id, self.prompt_token_ids, first.token_ids, d.finished, d.finish_reason,
                             first.text, d.error, self._metrics, d.text_delta, outputs)
