"""Sampling parameters and the sampler.

Operations:
- `SamplingParams(...)`: validated per-request parameters.
- `Sampler.sample(logits, requests)`: one next token per row (greedy rows in one argmax,
  random rows with each request's own seeded generator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature=0` is greedy; `top_k=None` and
    `top_p=1.0` disable those filters; `seed` makes random sampling reproducible.

    A request stops at an EOS token (unless `ignore_eos`), at any of `stop_token_ids`, or when
    its text contains one of the `stop` strings (that string and what follows are not
    returned). Before `min_tokens` tokens are out, EOS and `stop_token_ids` cannot be sampled and
    stop strings are not checked. `skip_special_tokens` drops special tokens from the text."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature: expected a number >= 0 (0 is greedy), got {self.temperature!r}")
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
        self._check_text_fields()

    def _check_text_fields(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: expected a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not (
            0 <= self.min_tokens <= self.max_tokens
        ):
            raise ValueError(f"min_tokens: expected an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens: expected true or false, got {self.skip_special_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns last-token logits into next tokens."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        banned: Sequence[tuple[int, ...]] | None = None,
    ) -> list[int]:
        """`logits` is `[n, vocab]`; row i is sampled with `params[i]` and `generators[i]`, never
        picking a token of `banned[i]`."""
        if banned is not None and any(banned):
            logits = _ban(logits, banned)
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_row(logits[i].float(), p, generators[i])
        return tokens

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
        logits = logits / p.temperature
        if p.top_k is not None and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            probs = probs.scatter(0, order[drop], 0.0)
        return int(torch.multinomial(probs, 1, generator=generator))


def _ban(logits: torch.Tensor, banned: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """A copy of `logits` with the banned tokens of each row at -inf (ids past the vocabulary
    cannot be sampled anyway)."""
    vocab = logits.shape[-1]
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if t < vocab]
    rows, cols = [i for i, _ in pairs], [t for _, t in pairs]
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits
