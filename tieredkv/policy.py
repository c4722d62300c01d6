"""Preemption policy: what to do with a sequence that must leave the GPU.

`recompute` drops its KV and re-runs its prefill later. `swap` and `auto` need the CPU tier.
Policies are pure functions of the sequence and a cost model, testable without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from tieredkv.sequence import Sequence

if TYPE_CHECKING:
    from tieredkv.config import EngineConfig

PreemptionKind = Literal["recompute", "swap"]


class PreemptionPolicy(Protocol):
    def decide(self, seq: Sequence) -> PreemptionKind: ...


class RecomputePolicy:
    """Always drop the KV; the prefix cache may still serve its full blocks later."""

    def decide(self, seq: Sequence) -> PreemptionKind:
        return "recompute"


def make_policy(config: EngineConfig) -> PreemptionPolicy:
    """The policy named by `scheduler.preemption`."""
    kind = config.scheduler.preemption
    if kind == "recompute":
        return RecomputePolicy()
    raise ValueError(
        f"preemption: {kind!r} needs the CPU tier, which this build does not have yet; use 'recompute'"
    )
