"""Sampling parameters and the sampler.

Operations:
- `SamplingParams(...)`: validated per-request parameters.
- `Sampler.sample(logits, requests)`: one next token per row (greedy rows in one argmax,
  random rows with each request's own seeded generator); a row that cannot be sampled gets a
  `FailedSample`, which fails that request alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a subnormal
# temperature overflows to inf, and the distribution is an argmax long before that anyway.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature` below `SAMPLING_EPS` (1e-5) is greedy;
    `inf` is uniform over the tokens `top_k` and `top_p` keep; `top_k=None` and `top_p=1.0`
    disable those filters; `seed` makes random sampling reproducible."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ValueError(f"temperature: expected a number >= 0 (0 is greedy), got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k: expected an integer >= 1, or None to disable, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed: expected an integer >= 0 or None, got {self.seed!r}")
        stop = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids: expected non-negative token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class FailedSample:
    """A row the sampler could not sample (e.g. its probabilities are not finite): the request
    ends with `finish_reason="error"` and this message."""

    message: str


class Sampler:
    """Turns last-token logits into next tokens."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int | FailedSample]:
        """`logits` is `[n, vocab]`; row i is sampled with `params[i]` and `generators[i]`.
        A row that cannot be sampled gets a `FailedSample`; the other rows are unaffected."""
        tokens: list[int | FailedSample] = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_row(logits[i].float(), p, generators[i])
        return tokens

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int | FailedSample:
        probs = _probabilities(logits, p)
        # checked here: on CUDA, multinomial over NaN is a device-side assert that kills the process
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
            message = f"sampling: the next-token probabilities are not finite (temperature {p.temperature})"
            logger.warning("request failed: %s", message)
            return FailedSample(message)
        return int(torch.multinomial(probs, 1, generator=generator))


def _probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax of `logits / temperature` over the tokens top-k and top-p keep. Top-k is chosen on
    the raw logits (the same tokens for any temperature > 0, and still the best ones when an
    infinite temperature makes every scaled logit 0)."""
    scaled = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        scaled = scaled.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    return probs
