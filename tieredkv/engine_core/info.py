"""`EngineInfo`: what a front end knows of a built engine.

Computed once in the process that runs the engine and copied to the one that serves it, so a
server reads its model's limits, sizes and start-up state without asking the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tieredkv.config import EngineConfig
from tieredkv.engine import LLMEngine
from tieredkv.limits import RequestLimits
from tieredkv.policy import CostModel


@dataclass(frozen=True)
class EngineInfo:
    """The engine's resolved config, request limits, KV bytes per block, cost model (None
    without one) and its `stats()` right after start-up."""

    config: EngineConfig
    limits: RequestLimits
    block_bytes: int
    cost_model: CostModel | None
    startup_stats: dict[str, Any]

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.config, engine.limits, engine.block_bytes, engine.scheduler.policy.cost, engine.stats())
