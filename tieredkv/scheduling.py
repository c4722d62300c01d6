"""How one step's token budget (`max_num_batched_tokens`) is shared: a pure policy over plain
numbers, testable with no model.

Policies (`scheduler.scheduling_policy`):
- `fcfs`: running sequences oldest first, each taking up to the whole budget, then swapped ones,
  then waiting ones in arrival order. A long prompt holds everything behind it, decodes too.
- `ttft`: decodes first (one token each, so inter-token latency is one step); then every
  other sequence, a prefill partly done, swapped out or waiting, in `prefill_order`: fewest
  tokens left to compute first (KV found resident in the GPU or CPU tier, or swapped out,
  counts as computed), less an aging credit, so a long prompt is never starved; the budget is
  shared by `share_budget`, at most `max_prefill_chunk_tokens` each while others still want
  tokens. A swapped-out sequence comes back in its turn, not ahead of everyone: one preempted
  because it ranked last would otherwise hold every shorter prompt behind the blocks it needs.
- `hrrn`: as `ttft`, but prefills go in order of highest response ratio next, (wait +
  service) / service, both in tokens of work (`response_ratio`): a request's rank grows with
  its wait relative to its size, so each waits in proportion to its size rather than behind
  every shorter one. A fresh arrival (ratio 1) runs after everyone who has waited.

Operations:
- `prefill_priority(remaining_tokens, waited_tokens, aging) -> float`: lower runs first.
- `response_ratio(remaining_tokens, waited_tokens) -> float`: higher runs first (`hrrn`).
- `prefill_order(candidates, aging, policy) -> list[int]`: the order of the prefill candidates.
- `share_budget(wants, budget, cap) -> list[int]`: tokens for each, in that order.
- `PrefillShares(candidates, budget, ...)`: one step's prefills in that order, each offered its
  share as it comes; what one does not take goes to those after it.

Aging counts work, not seconds: `waited_tokens` are the tokens the engine scheduled (for anyone)
since the request arrived. A request with R tokens left ranks ahead of every request arriving
later once `aging * waited_tokens >= R`, so it waits behind at most R / `aging` tokens of other
work plus what arrived before it; with `aging` 0 it may starve, with a large one the order is
close to arrival order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

SchedulingPolicy = Literal["fcfs", "ttft", "hrrn"]


class PrefillCandidate(NamedTuple):
    """A sequence that still has prompt tokens to compute, as the policy sees it."""

    remaining_tokens: int  # tokens left to compute (resident KV counts as computed)
    waited_tokens: int  # tokens the engine scheduled since the request arrived
    computed_tokens: int = 0  # tokens before its next chunk (computed or resident)


def prefill_priority(remaining_tokens: int, waited_tokens: int, aging: float) -> float:
    """The rank of a prefill: tokens left to compute, less `aging` per token of work it waited
    through (lower runs first)."""
    return remaining_tokens - aging * waited_tokens


def response_ratio(remaining_tokens: int, waited_tokens: int) -> float:
    """(wait + service) / service, both in tokens of work (higher runs first)."""
    return (waited_tokens + remaining_tokens) / max(remaining_tokens, 1)


def prefill_order(candidates: Sequence[PrefillCandidate], aging: float, policy: SchedulingPolicy = "ttft") -> list[int]:
    """Indices of `candidates`, the one to run first first; ties keep the given order (give it
    oldest first)."""
    if policy == "hrrn":
        keys = [-response_ratio(c.remaining_tokens, c.waited_tokens) for c in candidates]
    else:
        keys = [prefill_priority(c.remaining_tokens, c.waited_tokens, aging) for c in candidates]
    return sorted(range(len(candidates)), key=keys.__getitem__)


def share_budget(wants: Sequence[float], budget: float, cap: float | None) -> list[float]:
    """What each request gets of `budget` this step, `wants` in priority order: at most `cap`
    each (None: no cap), in order, then what is left in the same order, so that nothing is left
    while someone wants it (tokens, or `chunk_cost`s).

        wants [5000, 300, 4000], budget 2048, cap 512  ->  first pass [512, 300, 512]
        724 left  ->  [1236, 300, 512]
    """
    assert budget >= 0 and all(w >= 0 for w in wants), "budget and wants are token counts"
    first = [min(w, cap) if cap is not None else w for w in wants]
    shares, left = [], budget
    for w in first:
        shares.append(min(w, left))
        left -= shares[-1]
    for i, w in enumerate(wants):
        if left == 0:
            break
        more = min(w - shares[i], left)
        shares[i] += more
        left -= more
    return shares


def chunk_cost(done: int, new: int, attention: float) -> float:
    """What a chunk of `new` tokens after `done` takes of the budget, counted in tokens at the
    start of a prompt. A prompt of N tokens costs a*N + b*N^2 (the cost model's
    `prefill_s_per_token`, `prefill_s_per_token_sq`), so the chunk costs a*new + b*((done +
    new)^2 - done^2): `new` tokens plus `attention` = b/a times the (query, key) pairs it adds.
    With `attention` 0 a token is a token."""
    return new + attention * ((done + new) ** 2 - done**2)


def chunk_tokens(done: int, budget: float, attention: float) -> int:
    """The most tokens after `done` whose `chunk_cost` fits in `budget`."""
    if attention <= 0:
        return max(0, math.floor(budget + 1e-9))
    slope = 1 + 2 * attention * done  # cost = attention*n^2 + slope*n
    n = math.floor((-slope + math.sqrt(slope * slope + 4 * attention * budget)) / (2 * attention))
    while n > 0 and chunk_cost(done, n, attention) > budget + 1e-9:
        n -= 1
    while chunk_cost(done, n + 1, attention) <= budget + 1e-9:
        n += 1
    return max(n, 0)


class PrefillShares:
    """One step's prefill candidates in the policy's order, each offered its share of the
    budget, each chunk charged for its attention (`chunk_cost`). Iterating yields (index into
    the candidates, tokens offered) while budget is left; answer each with `took(n)`: a
    candidate that takes less than its share leaves the rest to those after it."""

    def __init__(self, candidates: Sequence[PrefillCandidate], budget: float, aging: float,
                 policy: SchedulingPolicy, cap: int | None, attention: float) -> None:
        self.candidates = candidates
        self.order = prefill_order(candidates, aging, policy)
        self.budget = budget
        self._cap, self._attention = cap, attention
        self._wants = [chunk_cost(candidates[i].computed_tokens, candidates[i].remaining_tokens, attention)
                       for i in self.order]
        self._shares = share_budget(self._wants, budget, cap)
        self._at, self._offered = 0, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for k, i in enumerate(self.order):
            if self.budget <= 0:
                return
            self._at = k
            self._offered = chunk_tokens(self.candidates[i].computed_tokens, self._shares[k], self._attention)
            yield i, self._offered

    def ranked_after(self) -> list[int]:
        """The candidates after the one offered last, in order."""
        return self.order[self._at + 1 :]

    def took(self, n: int) -> None:
        """The candidate offered last took `n` tokens."""
        k = self._at
        self.budget -= chunk_cost(self.candidates[self.order[k]].computed_tokens, n, self._attention)
        if n != self._offered:  # it took less than its share: the rest goes to those after it
            self._shares[k + 1 :] = share_budget(self._wants[k + 1 :], max(self.budget, 0), self._cap)
