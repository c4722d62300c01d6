"""Preemption policy: what to do with a sequence that must leave the GPU.

- `recompute`: drop its KV; its prefill re-runs later (the prefix cache may still hold blocks).
- `swap`: copy its KV to the CPU tier and back (needs CPU room).
- `auto`: whichever the cost model says is cheaper, per sequence.

`choose_preemption` is a pure function of the sequence's size, the CPU room and a `CostModel`.
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

    def __post_init__(self) -> None:
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
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


@dataclass(frozen=True)
class PreemptionPolicy:
    """The configured mode with what `choose_preemption` needs besides the sequence."""

    mode: Preemption
    block_bytes: int
    cost: CostModel | None = None

    def decide(self, num_tokens: int, num_blocks: int, cpu_free_blocks: int) -> PreemptionKind:
        return choose_preemption(self.mode, num_tokens, num_blocks, self.block_bytes, cpu_free_blocks, self.cost)
