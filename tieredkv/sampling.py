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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tieredkv.values import check_text, is_int, is_real

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a subnormal
# temperature overflows to inf, and the distribution is an argmax long before that anyway.
SAMPLING_EPS = 1e-5
# a request's stop conditions are checked at every token it samples: bounded, so that one
# request cannot slow the step of every other (OpenAI takes 4 stop strings)
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 256, 1024, 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature` below `SAMPLING_EPS` (1e-5) is greedy;
    `inf` is uniform over the tokens `top_k` and `top_p` keep; `top_k=None` and `top_p=1.0`
    disable those filters; `seed` makes random sampling reproducible.

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
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not is_real(t) or math.isnan(t) or t < 0:
            raise ValueError(f"temperature: expected a number >= 0 (0 is greedy), got {t!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1] (1 disables it), got {self.top_p!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos: expected True or False, got {self.ignore_eos!r}")
        self._set("max_tokens", _integer("max_tokens", self.max_tokens, ">= 1", 1))
        self._set("temperature", float(t))
        self._set("top_p", float(self.top_p))
        if self.top_k is not None:
            self._set("top_k", _integer("top_k", self.top_k, ">= 1, or None to disable", 1))
        if self.seed is not None:
            self._set("seed", _integer("seed", self.seed, "in [0, 2**64), or None", 0, 2**64))
        self._set("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        self._set("ignore_eos", bool(self.ignore_eos))

        self._check_text_fields()
        self._check_fork_fields()

    def _set(self, name: str, value: object) -> None:
        """Store the normalized value of a field (plain ints and floats, not numpy scalars)."""
        object.__setattr__(self, name, value)

    def _check_text_fields(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: expected a non-empty string or a list of them, got {_short(self.stop)}")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters "
                             f"each, got {len(stop)} of up to {max(map(len, stop))} characters")
        object.__setattr__(self, "stop", tuple(check_text(s, "stop") for s in stop))
        self._set("min_tokens", _integer("min_tokens", self.min_tokens, f"in [0, max_tokens={self.max_tokens}]",
                                         0, self.max_tokens + 1))
        if not isinstance(self.skip_special_tokens, (bool, np.bool_)):
            raise ValueError(f"skip_special_tokens: expected true or false, got {self.skip_special_tokens!r}")
        self._set("skip_special_tokens", bool(self.skip_special_tokens))

    def _check_fork_fields(self) -> None:
        self._set("n", _integer("n", self.n, ">= 1 (samples per request)", 1))
        if self.best_of is not None:
            self._set("best_of", _integer("best_of", self.best_of, f">= n ({self.n}), or None", self.n))
        if self.logprobs is not None:
            self._set("logprobs", _integer("logprobs", self.logprobs, ">= 0 (top tokens per position), or None", 0))

    @property
    def num_samples(self) -> int:
        """Samples drawn: `best_of`, else `n`."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _integer(name: str, value: object, expected: str, low: int, high: int | None = None) -> int:
    """`value` as a plain int in `[low, high)`; ValueError naming the field otherwise."""
    if not is_int(value) or value < low or (high is not None and value >= high):
        raise ValueError(f"{name}: expected an integer {expected}, got {value!r}")
    return int(value)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    """Stop token ids as a tuple of plain ints; one id alone counts as a list of one."""
    if is_int(value):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"stop_token_ids: expected a list of non-negative token ids, got {_short(value)}")
    ids = tuple(value)
    if not all(is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids: expected a list of non-negative token ids, got {_short(value)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
    return tuple(int(t) for t in ids)


def _short(value: object, limit: int = 200) -> str:
    """`repr(value)`, cut to `limit` characters (an error message quotes what it refuses)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


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
        banned: Sequence[tuple[int, ...]] | None = None,
    ) -> list[int | FailedSample]:
        """`logits` is `[n, vocab]`; row i is sampled with `params[i]` and `generators[i]`, never
        picking a token of `banned[i]`. A row that cannot be sampled gets a `FailedSample`; the
        other rows are unaffected."""
        if banned is not None and any(banned):
            logits = _ban(logits, banned)
        best, argmax = logits.max(dim=-1)
        # a row whose best logit is -inf (every token banned) or NaN has no greedy token
        rows = torch.stack([argmax, (best > float("-inf")).long()]).tolist()  # one host sync
        tokens: list[int | FailedSample] = list(rows[0])
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = self._sample_row(logits[i].float(), p, generators[i])
            elif not rows[1][i]:
                tokens[i] = _failed("sampling: no token can be drawn: every one is banned (min_tokens bans EOS "
                                    "and stop_token_ids until it is reached) or the logits are not finite")
        return tokens

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int | FailedSample:
        probs = _probabilities(logits, p)
        # checked here: on CUDA, multinomial over NaN is a device-side assert that kills the process
        if not bool(torch.isfinite(probs).all() & (probs.sum() > 0)):  # one host sync
            return _failed(f"sampling: the next-token probabilities are not finite (temperature {p.temperature})")
        return int(torch.multinomial(probs, 1, generator=generator))


def _failed(message: str) -> FailedSample:
    logger.warning("request failed: %s", message)
    return FailedSample(message)


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
        # keep the smallest prefix whose mass reaches top_p; the first token always stays, also
        # where top_p rounds to 0 in the probabilities' dtype (1e-46 in float32)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False
        probs = probs.scatter(0, order[drop], 0.0)
    return probs


def _ban(logits: torch.Tensor, banned: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """A copy of `logits` with the banned tokens of each row at -inf (ids past the vocabulary
    cannot be sampled anyway)."""
    vocab = logits.shape[-1]
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if t < vocab]
    rows, cols = [i for i, _ in pairs], [t for _, t in pairs]
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits
