"""Tier policy, as pure functions over a cost model.

Preemption: what to do with a sequence that must leave the GPU.
- `recompute`: drop its KV; its prefill re-runs later (the prefix cache may still hold blocks).
- `swap`: copy its KV to the CPU tier and back (needs CPU room).
- `auto`: whichever the cost model says is cheaper, per sequence.

Slow-tier hits: whether prefix blocks found on NVMe are loaded or recomputed
(`choose_nvme_load`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Preemption = Literal["auto", "swap", "recompute"]
PreemptionKind = Literal["recompute", "swap"]


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
            if not getattr(self, name) > 0:
                raise ValueError(f"cost_model.{name}: expected a positive number, got {getattr(self, name)!r}")
        for name in ("prefill_s_per_token", "prefill_s_per_token_sq"):
            if not getattr(self, name) >= 0:
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


def choose_nvme_load(num_blocks: int, block_bytes: int, first_token: int, block_size: int, cost: CostModel | None) -> bool:
    """Load `num_blocks` prefix blocks found on NVMe (starting at token `first_token`), or
    recompute them? Loading costs disk reads plus the H2D copy; recomputing costs the extra
    prefill of those tokens. Without a measured disk bandwidth, load."""
    if cost is None or cost.disk_read_bytes_per_s is None:
        return True
    num_bytes = num_blocks * block_bytes
    load_s = num_bytes / cost.disk_read_bytes_per_s + num_bytes / cost.h2d_bytes_per_s
    end = first_token + num_blocks * block_size
    recompute_s = cost.recompute_s(end) - cost.recompute_s(first_token)
    return load_s < recompute_s


@dataclass(frozen=True)
class TierPolicy:
    """The configured preemption mode and the cost model, bound to the KV block size."""

    mode: Preemption
    block_bytes: int
    block_size: int = 16
    cost: CostModel | None = None

    def preemption(self, num_tokens: int, num_blocks: int, cpu_free_blocks: int) -> PreemptionKind:
        return choose_preemption(self.mode, num_tokens, num_blocks, self.block_bytes, cpu_free_blocks, self.cost)

    def load_from_nvme(self, num_blocks: int, first_token: int) -> bool:
        return choose_nvme_load(num_blocks, self.block_bytes, first_token, self.block_size, self.cost)
