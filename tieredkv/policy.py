"""Tier policy, as pure functions over a cost model.

Preemption: what to do with a sequence that must leave the GPU.
- `recompute`: drop its KV; its prefill re-runs later (the prefix cache may still hold blocks).
- `swap`: copy its KV to the CPU tier and back (needs CPU room).
- `auto`: whichever the cost model says is cheaper, per sequence.

CPU-tier hits: copied in, unless the PCIe queue makes recomputing them faster
(`promote_cpu_hits`).

Slow-tier hits: prefix blocks found on NVMe are loaded, recomputed, or both at once
(`split_nvme_prefix`), against the disk bandwidth the engine observes (`ObservedRate`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Literal

Preemption = Literal["auto", "swap", "recompute"]
PreemptionKind = Literal["recompute", "swap"]


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class CostModel:
    """Measured (or pinned) speeds: PCIe each way, and prefill time as a function of length
    (`a*n + b*n^2`: the quadratic term is attention)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    prefill_s_per_token: float
    prefill_s_per_token_sq: float = 0.0
    disk_read_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s", "disk_read_bytes_per_s"):
            if name == "disk_read_bytes_per_s" and self.disk_read_bytes_per_s is None:
                continue
            if not _is_number(getattr(self, name)) or not getattr(self, name) > 0:
                raise ValueError(f"cost_model.{name}: expected a positive number, got {getattr(self, name)!r}")
        for name in ("prefill_s_per_token", "prefill_s_per_token_sq"):
            if not _is_number(getattr(self, name)) or not getattr(self, name) >= 0:
                raise ValueError(f"cost_model.{name}: expected a number >= 0, got {getattr(self, name)!r}")

    def swap_s(self, num_bytes: int) -> float:
        """Time to copy `num_bytes` out and back in."""
        return num_bytes / self.d2h_bytes_per_s + num_bytes / self.h2d_bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        """Time to prefill `num_tokens` tokens again."""
        return self.prefill_s_per_token * num_tokens + self.prefill_s_per_token_sq * num_tokens**2


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


def split_nvme_prefix(
    num_blocks: int, block_bytes: int, first_token: int, block_size: int, cost: CostModel | None,
    disk_queue_bytes: int = 0, gpu_queue_tokens: int = 0,
) -> int:
    """How many of the `num_blocks` prefix blocks found on NVMe (from token `first_token` on)
    to recompute; the rest, the later ones, are loaded at the same time.

        tokens:  [ hits | compute c blocks ──► | ◄── load num_blocks - c blocks | rest of prompt ]

    The GPU computes forward from the hits while the disk reads the later blocks; c is chosen
    so both finish together (the larger of the two times is smallest). Both start behind their
    queues: the disk after the `disk_queue_bytes` already queued for reads, the GPU after the
    `gpu_queue_tokens` of prefill already scheduled ahead of this request, so a disk shared by
    many requests loads less for each. 0 loads everything, `num_blocks` recomputes everything.
    Without a measured disk bandwidth, load everything.
    """
    if cost is None or cost.disk_read_bytes_per_s is None:
        return 0
    per_block_load = block_bytes / cost.disk_read_bytes_per_s + block_bytes / cost.h2d_bytes_per_s
    disk_wait = disk_queue_bytes / cost.disk_read_bytes_per_s
    gpu_wait = cost.recompute_s(gpu_queue_tokens)

    def finish_s(c: int) -> float:
        compute = gpu_wait + cost.recompute_s(first_token + c * block_size) - cost.recompute_s(first_token)
        load = disk_wait + (num_blocks - c) * per_block_load if c < num_blocks else 0.0
        return max(compute, load)

    return min(range(num_blocks + 1), key=finish_s)


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
    return copy_s <= cost.recompute_s(first_token + num_blocks * block_size) - cost.recompute_s(first_token)


class ObservedRate:
    """A bandwidth as the engine gets it: bytes moved over the seconds something was in flight,
    recent seconds weighing most (what came `half_life_s` of busy time ago counts half). It
    starts from the calibrated `prior`, worth `prior_s` busy seconds, so a disk slower (or
    faster) than calibrated is corrected within a few seconds of use."""

    def __init__(self, prior: float, half_life_s: float = 0.5, prior_s: float = 0.1) -> None:
        self.half_life_s = half_life_s
        self._bytes, self._seconds = prior * prior_s, prior_s
        self._seen = (0, 0.0)  # the cumulative counters at the last update

    @property
    def bytes_per_s(self) -> float:
        return self._bytes / self._seconds

    def update(self, total_bytes: int, total_busy_s: float) -> None:
        """Take in cumulative counters (bytes moved, seconds busy) read from the device."""
        nbytes, seconds = total_bytes - self._seen[0], total_busy_s - self._seen[1]
        self._seen = (total_bytes, total_busy_s)
        if seconds <= 0:
            return
        keep = 0.5 ** (seconds / self.half_life_s)
        self._bytes = self._bytes * keep + nbytes
        self._seconds = self._seconds * keep + seconds


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

    def nvme_blocks_to_compute(
        self, num_blocks: int, first_token: int, disk_queue_blocks: int = 0, gpu_queue_tokens: int = 0,
        disk_bytes_per_s: float | None = None,
    ) -> int:
        """`split_nvme_prefix` with the queues, at `disk_bytes_per_s` (the observed bandwidth)
        where given, else the calibrated one."""
        cost = self.cost
        if cost is not None and disk_bytes_per_s is not None:
            cost = replace(cost, disk_read_bytes_per_s=disk_bytes_per_s)
        return split_nvme_prefix(
            num_blocks, self.block_bytes, first_token, self.block_size, cost,
            disk_queue_blocks * self.block_bytes, gpu_queue_tokens,
        )
