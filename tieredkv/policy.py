"""Tier policy, as pure functions over a cost model.

Preemption: what to do with a sequence that must leave the GPU.
- `recompute`: drop its KV; its prefill re-runs later (the prefix cache may still hold blocks).
- `swap`: copy its KV to the CPU tier and back (needs CPU room).
- `auto`: whichever the cost model says is cheaper, per sequence.

CPU-tier hits: copied in, unless the PCIe queue makes recomputing them faster
(`promote_cpu_hits`).

Slow-tier hits: prefix blocks found in the lower tier (disk or remote) are loaded, recomputed,
or both at once (`split_lower_prefix`); a load costs a fixed latency plus its bytes over the read
rate, both as the engine observes them (`ObservedLoads`).

An engine measures a cost model where it needs one and none is pinned (`needs_cost_model`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Literal

Preemption = Literal["auto", "swap", "recompute"]
LOAD_MARGIN = 0.1  # a lower-tier load must save this share of the time computing its blocks takes
PreemptionKind = Literal["recompute", "swap"]


def needs_cost_model(scheduling_policy: str, preemption: Preemption, cpu_tier: bool, lower_tier: bool) -> bool:
    """Whether an engine needs a cost model: to price prefill chunks (`ttft` and `hrrn` charge
    each chunk its attention, with or without tiers, so that every tier configuration runs the
    same schedule), to choose swap or recompute (`auto` with a CPU tier), and to choose load or
    compute (a tier below the CPU)."""
    return scheduling_policy != "fcfs" or (cpu_tier and (preemption == "auto" or lower_tier))


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class CostModel:
    """Measured (or pinned) speeds: PCIe each way, and prefill time as a function of length
    (`a*n + b*n^2`: the quadratic term is attention); the lower tier's (disk or remote) read
    rate, and `read_latency_s`, the fixed time of one of its loads whatever its size (a round
    trip, the step that takes the blocks in)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    prefill_s_per_token: float
    prefill_s_per_token_sq: float = 0.0
    disk_read_bytes_per_s: float | None = None
    read_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s", "disk_read_bytes_per_s"):
            if name == "disk_read_bytes_per_s" and self.disk_read_bytes_per_s is None:
                continue
            if not _is_number(getattr(self, name)) or not getattr(self, name) > 0:
                raise ValueError(f"cost_model.{name}: expected a positive number, got {getattr(self, name)!r}")
        for name in ("prefill_s_per_token", "prefill_s_per_token_sq", "read_latency_s"):
            if not _is_number(getattr(self, name)) or not getattr(self, name) >= 0:
                raise ValueError(f"cost_model.{name}: expected a number >= 0, got {getattr(self, name)!r}")

    def swap_s(self, num_bytes: int) -> float:
        """Time to copy `num_bytes` out and back in."""
        return num_bytes / self.d2h_bytes_per_s + num_bytes / self.h2d_bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        """Time to prefill `num_tokens` tokens again."""
        return self.prefill_s_per_token * num_tokens + self.prefill_s_per_token_sq * num_tokens**2

    def extend_s(self, first_token: int, num_tokens: int) -> float:
        """Time to prefill `num_tokens` tokens after the first `first_token` (their attention
        covers those before them)."""
        return self.recompute_s(first_token + num_tokens) - self.recompute_s(first_token)


def choose_preemption(
    mode: Preemption, num_tokens: int, num_blocks: int, block_bytes: int, cpu_free_blocks: int, cost: CostModel | None
) -> PreemptionKind:
    """The preemption for a sequence of `num_tokens` computed tokens in `num_blocks` blocks.
    Without CPU room, or without a cost model for `auto`, it is recompute."""
    if mode == "recompute" or num_blocks > cpu_free_blocks:
        return "recompute"
    if mode == "swap":
        return "swap"
    if cost is None:
        return "recompute"
    return "swap" if cost.swap_s(num_blocks * block_bytes) < cost.recompute_s(num_tokens) else "recompute"


def split_lower_prefix(
    num_blocks: int, block_bytes: int, first_token: int, block_size: int, cost: CostModel | None,
    lower_queue_bytes: int = 0, gpu_queue_tokens: int = 0,
) -> int:
    """How many of the `num_blocks` prefix blocks found in the lower tier (disk or remote, from
    token `first_token` on) to recompute; the rest, the later ones, are loaded at the same time.

        tokens:  [ hits | compute c blocks ──► | ◄── load num_blocks - c blocks | rest of prompt ]

    The GPU computes forward from the hits while the tier reads the later blocks; c is the split
    that finishes first (the larger of the two times is smallest). Behind a queue (reads in
    flight, or prefill ahead of the request) it loads only blocks whose load alone beats
    computing them by `LOAD_MARGIN` (`first_paying_block`), or that land before the GPU queue
    ahead of the request is done: a shallow block's prefill is cheap, and a load that pays only
    through the overlap with the request's own prefill moves disk time, and the request's place
    in the schedule, for little (on a 1.5 GB/s disk, 16 MiB blocks of llama-3-8b pay from ~52k
    tokens deep, from ~16k at 3 GB/s, all at 6 GB/s; on the simulated clock at 1.5 GB/s, over
    eight real-trace slices each perturbed five ways, this rule cut the cells where the store is
    over 5% worse than its CPU tier alone from 21 / 13 / 10 to 15 / 7 / 5 of 40 on TTFT p50 /
    p90 / p99, BENCHMARKS.md). With both queues empty the overlap is the request's alone to
    win, and costs no other: a document revisited on an idle engine reads its later part while
    the GPU computes the rest (BENCHMARKS.md, "Documents revisited on the simulated clock").
    Loading k blocks costs `read_latency_s` + k blocks over the read rate and over PCIe; both
    start behind their queues: the tier after the `lower_queue_bytes` already queued for reads,
    the GPU after the `gpu_queue_tokens` of prefill already scheduled ahead of this request.
    Loading must save at least `LOAD_MARGIN` of the time computing the blocks takes, else they
    are all computed (when the two are close, computing risks nothing). 0 loads everything,
    `num_blocks` recomputes everything. Without a measured read rate, load everything.
    """
    if cost is None or cost.disk_read_bytes_per_s is None:
        return 0
    per_block_load = block_bytes / cost.disk_read_bytes_per_s + block_bytes / cost.h2d_bytes_per_s
    load_wait = cost.read_latency_s + lower_queue_bytes / cost.disk_read_bytes_per_s
    gpu_wait = cost.recompute_s(gpu_queue_tokens)

    def compute_s(c: int) -> float:
        return gpu_wait + cost.extend_s(first_token, c * block_size)

    def load_s(c: int) -> float:
        return load_wait + (num_blocks - c) * per_block_load if c < num_blocks else 0.0

    def finish_s(c: int) -> float:
        return max(compute_s(c), load_s(c))

    # computing takes longer the more blocks it covers, loading shorter: the split that finishes
    # first is beside the first c whose compute is no shorter than its load (bisection: a plan
    # is made on the engine loop, for prefixes of thousands of blocks)
    # loaded: blocks that pay alone, and any that land before the GPU gets to the request
    in_time = (gpu_wait - load_wait) / per_block_load  # blocks that land before the GPU is free
    lands_in_time = num_blocks if in_time < 0 else max(0, num_blocks - math.floor(in_time + 1e-9))
    alone = lower_queue_bytes == 0 and gpu_queue_tokens == 0
    first = 0 if alone else min(first_paying_block(num_blocks, per_block_load, first_token, block_size, cost),
                                lands_in_time)
    if first == num_blocks:
        return num_blocks
    lo, hi = first, num_blocks
    while lo < hi:
        mid = (lo + hi) // 2
        if compute_s(mid) >= load_s(mid):
            hi = mid
        else:
            lo = mid + 1
    best = lo - 1 if lo > first and finish_s(lo - 1) <= finish_s(lo) else lo
    margin = LOAD_MARGIN * cost.extend_s(first_token, num_blocks * block_size)
    return best if finish_s(best) <= finish_s(num_blocks) - margin else num_blocks


def first_paying_block(num_blocks: int, per_block_load_s: float, first_token: int, block_size: int,
                       cost: CostModel) -> int:
    """The first of `num_blocks` prefix blocks (from token `first_token` on) whose load,
    `per_block_load_s`, saves `LOAD_MARGIN` of computing it; `num_blocks` if none does. A
    block's prefill grows with its depth (its attention), so every later one pays too."""
    needed = per_block_load_s / (1 - LOAD_MARGIN)
    if cost.extend_s(first_token, block_size) >= needed:
        return 0
    a, b, n = cost.prefill_s_per_token, cost.prefill_s_per_token_sq, block_size
    if b <= 0:
        return num_blocks
    depth = (needed - a * n - b * n * n) / (2 * b * n)  # where a*n + b*(2*depth*n + n*n) reaches it
    return min(num_blocks, max(0, math.ceil((depth - first_token) / block_size)))


def wait_for_late_reads(
    num_blocks: int, block_bytes: int, first_token: int, block_size: int, cost: CostModel | None,
    queued_bytes: int, gpu_queue_tokens: int = 0, launch_s: float = 0.0, num_delayed: int = 0,
) -> bool:
    """Whether a sequence that reached its prefix blocks being read from the lower tier (the
    `num_blocks` still in flight, from token `first_token` on; `queued_bytes` of reads in
    flight up to its last one) waits for them rather than computes them behind
    `gpu_queue_tokens` of prefill. Its loads were planned against the queues of their moment;
    a sequence ranked ahead of where it was planned, or a tier slower than planned, finds them
    late. Waiting costs the queue's reads (part of which may be done) and the copy in,
    computing the blocks' prefill; computing must save `LOAD_MARGIN` of that prefill, as
    loading must when it is planned, so that the two never flip on noise (the reads go on
    either way, and what they bring lands in the CPU tier). The loop takes `launch_s` to make
    the chunk that follows: after the reads if it waits, beside the GPU's queue if it computes.
    Computing also puts the blocks' prefill before the `num_delayed` other sequences with
    prefill to compute, each of them as late again, where waiting costs them nothing (they use
    the GPU meanwhile): it counts once for each. Without a read rate, wait."""
    if cost is None or cost.disk_read_bytes_per_s is None:
        return True
    wait_s = queued_bytes / cost.disk_read_bytes_per_s + num_blocks * block_bytes / cost.h2d_bytes_per_s + launch_s
    prefill_s = cost.extend_s(first_token, num_blocks * block_size) * (1 + num_delayed)
    return max(cost.recompute_s(gpu_queue_tokens), launch_s) + (1 + LOAD_MARGIN) * prefill_s >= wait_s


def promote_cpu_hits(
    num_blocks: int, block_bytes: int, first_token: int, block_size: int, cost: CostModel | None,
    h2d_queue_bytes: int = 0,
) -> bool:
    """Whether to copy `num_blocks` prefix blocks found in the CPU tier (from token
    `first_token` on) to the GPU, behind the `h2d_queue_bytes` already queued over PCIe,
    rather than recompute them. Without a cost model, copy."""
    if cost is None:
        return True
    copy_s = (h2d_queue_bytes + num_blocks * block_bytes) / cost.h2d_bytes_per_s
    return copy_s <= cost.extend_s(first_token, num_blocks * block_size)


class ObservedLoads:
    """How long a lower-tier load of some bytes takes as its request sees it: `latency_s` +
    bytes / `bytes_per_s`, the line fitted (weighted least squares) to completed loads (bytes,
    seconds from submission until the request could use them), the latest weighing most (a
    load `half_life` loads ago counts half). The calibrated `rate` and `latency_s` hold until a
    load is seen; from then on the calibrated rate stays in the fit as one point of its line,
    where it reads for `PRIOR_S`, worth `prior_loads` loads (never less than `MIN_PRIOR_LOADS`)
    and no more leverage than a load of the sizes seen: loads all of one size teach the latency
    without making up a rate, loads of several sizes teach both. What was learned is dropped
    once no load has been seen for `QUIET_S` (`age`): a tier whose loads stalled (given up after
    seconds, which made the fit say that no load pays, so none was tried again) is tried again
    at the calibrated figures after a quiet while, not never."""

    PRIOR_S = 0.1
    MIN_PRIOR_LOADS = 0.05
    QUIET_S = 30.0

    def __init__(self, rate: float, latency_s: float = 0.0, half_life: float = 4.0, prior_loads: float = 1.0) -> None:
        self._prior = (rate * self.PRIOR_S, latency_s + self.PRIOR_S)  # (bytes, seconds) on the calibrated line
        self._keep = 0.5 ** (1 / half_life)
        self._prior_loads = prior_loads
        self._prior_rate, self._prior_latency_s = rate, latency_s
        self._seen_at: float | None = None  # when `age` last found a load added since its last call
        self._fresh = False
        self._forget()

    def _forget(self) -> None:
        """Back to the calibrated figures, as before any load was seen."""
        self._prior_weight = self._prior_loads
        self._sums = [0.0] * 5  # weights, x, y, x*x, x*y of the loads seen (x bytes, y seconds)
        self.bytes_per_s, self.latency_s = self._prior_rate, self._prior_latency_s

    def age(self, now: float) -> None:
        """Drop what was learned if no load was added for `QUIET_S` before `now` (a monotonic
        clock's seconds; called as time passes, e.g. once a step)."""
        if self._fresh:
            self._seen_at, self._fresh = now, False
        elif self._seen_at is not None and now - self._seen_at >= self.QUIET_S:
            self._seen_at = None
            self._forget()

    def add(self, num_bytes: int, seconds: float) -> None:
        """Take in one completed load: `num_bytes` (with the reads queued ahead of it) landed
        `seconds` after they were submitted."""
        x, y = float(num_bytes), seconds
        self._fresh = True
        self._sums = [s * self._keep + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y), strict=True)]
        self._prior_weight = max(self.MIN_PRIOR_LOADS, self._prior_weight * self._keep)
        self.bytes_per_s, self.latency_s = self._fit()

    def _fit(self) -> tuple[float, float]:
        """(rate, latency) of the weighted least-squares line through the loads and the prior point."""
        (px, py), (w, sx, sy, sxx, sxy) = self._prior, self._sums
        pw = self._prior_weight * min(1.0, (sx / w / px) ** 2)  # no more leverage than the loads' sizes
        w, sx, sy, sxx, sxy = w + pw, sx + pw * px, sy + pw * py, sxx + pw * px * px, sxy + pw * px * py
        det = w * sxx - sx * sx
        slope = (w * sxy - sx * sy) / det if det > 0 else 0.0
        if slope <= 0:  # loads of one size only, or larger ones no slower (noise): the calibrated rate
            slope = 1 / self._prior_rate
        latency = (sy - slope * sx) / w
        if latency < 0:  # the line through the origin instead
            slope, latency = sxy / sxx, 0.0
        return 1 / slope, latency


@dataclass(frozen=True)
class TierPolicy:
    """The configured preemption mode and the cost model, bound to the KV block size."""

    mode: Preemption
    block_bytes: int
    block_size: int = 16
    cost: CostModel | None = None

    def preemption(self, num_tokens: int, num_blocks: int, cpu_free_blocks: int) -> PreemptionKind:
        return choose_preemption(self.mode, num_tokens, num_blocks, self.block_bytes, cpu_free_blocks, self.cost)

    def promote(self, num_blocks: int, first_token: int, h2d_queue_blocks: int = 0) -> bool:
        return promote_cpu_hits(
            num_blocks, self.block_bytes, first_token, self.block_size, self.cost, h2d_queue_blocks * self.block_bytes
        )

    def lower_blocks_to_compute(
        self, num_blocks: int, first_token: int, lower_queue_blocks: int = 0, gpu_queue_tokens: int = 0,
        observed: ObservedLoads | None = None,
    ) -> int:
        """`split_lower_prefix` with the queues, at the `observed` read rate and latency of the
        lower tier where given, else the calibrated ones."""
        return split_lower_prefix(
            num_blocks, self.block_bytes, first_token, self.block_size, self._cost(observed),
            lower_queue_blocks * self.block_bytes, gpu_queue_tokens,
        )

    def wait_for_reads(
        self, num_blocks: int, first_token: int, queued_blocks: int, gpu_queue_tokens: int = 0,
        observed: ObservedLoads | None = None, launch_s: float = 0.0, num_delayed: int = 0,
    ) -> bool:
        """`wait_for_late_reads`, at the `observed` read rate where given."""
        return wait_for_late_reads(
            num_blocks, self.block_bytes, first_token, self.block_size, self._cost(observed),
            queued_blocks * self.block_bytes, gpu_queue_tokens, launch_s, num_delayed,
        )

    def _cost(self, observed: ObservedLoads | None) -> CostModel | None:
        """The cost model with the lower tier's `observed` read rate and latency, where given."""
        if self.cost is None or observed is None:
            return self.cost
        return replace(self.cost, disk_read_bytes_per_s=observed.bytes_per_s, read_latency_s=observed.latency_s)
