"""How low any prefill order could take the TTFT tail of a run: a clairvoyant bound for
bench_scheduling (`--bound`).

The relaxation: one server that knows every arrival in advance, preempts for free, and does
nothing but prefills (no decodes, no step overhead, no KV memory limit), each request's
prefill taking what it takes alone after its cached prefix (`a*N + b*N^2` less the same of the
prefix: chunking changes nothing). A real scheduler does the same work and more, so no order
gets a tail below the bound.

Operations:
- `feasible(jobs, deadlines) -> bool`: whether every job can finish by its deadline
  (preemptive earliest-deadline-first with release times is optimal on one server).
- `least_tail(jobs, max_s, exceptions) -> float`: the least T such that all but `exceptions`
  of the jobs finish within T of their arrival and those within `max_s`.
- `exceptions_of(n) -> int`: how many requests above p99 the nearest-rank p99 of n leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Job = tuple[float, float]  # arrival s, seconds of work


def feasible(jobs: Sequence[Job], deadlines: Sequence[float]) -> bool:
    """Whether one preemptive server can finish every job by its deadline (absolute seconds):
    preemptive EDF, which meets every deadline whenever any order does."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    now, k, ready = 0.0, 0, []  # ready: [deadline, work left]
    while k < len(order) or ready:
        if not ready:
            now = max(now, jobs[order[k]][0])
        while k < len(order) and jobs[order[k]][0] <= now:
            heapq.heappush(ready, [deadlines[order[k]], jobs[order[k]][1]])
            k += 1
        next_arrival = jobs[order[k]][0] if k < len(order) else float("inf")
        ran = min(ready[0][1], next_arrival - now)
        now += ran
        ready[0][1] -= ran
        if ready[0][1] <= 1e-12:
            if now > heapq.heappop(ready)[0] + 1e-9:
                return False
    return True


def least_tail(jobs: Sequence[Job], max_s: float, exceptions: int, tolerance_s: float = 1e-3) -> float:
    """The least T (to `tolerance_s`) such that some order finishes every job within T of its
    arrival but `exceptions` (0 or 1) of them, which finish within `max_s`; inf if none does."""
    assert exceptions in (0, 1), "one request above the tail at most (p99 of fewer than 200 requests)"
    candidates = [None] if exceptions == 0 else range(len(jobs))
    best = float("inf")
    for skip in candidates:
        lo = max((w for i, (_, w) in enumerate(jobs) if i != skip), default=0.0)  # a job takes its work
        hi = min(best, max_s) if exceptions == 0 else best
        if hi == float("inf"):
            hi = lo + sum(w for _, w in jobs)  # every job's own work and all the others'
        if lo >= hi or not _fits(jobs, hi, skip, max_s):
            continue
        while hi - lo > tolerance_s:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if _fits(jobs, mid, skip, max_s) else (mid, hi)
        best = hi
    return best


def _fits(jobs: Sequence[Job], tail_s: float, skip: int | None, max_s: float) -> bool:
    """Whether every job can finish within `tail_s` of its arrival, job `skip` within `max_s`."""
    return feasible(jobs, [a + (max_s if i == skip else tail_s) for i, (a, _) in enumerate(jobs)])


def exceptions_of(n: int) -> int:
    """Requests slower than the nearest-rank p99 of `n` (tieredkv.experiment.metrics)."""
    rank = max(0, min(n - 1, round(0.99 * n + 0.5) - 1))
    return n - 1 - rank
