"""`EngineInfo`: what a front end knows of a built engine.

Computed once in the process that runs the engine and copied to the one that serves it, so a
server reads its model's limits, sizes and start-up state without asking the engine.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tieredkv.config import EngineConfig
from tieredkv.engine import LLMEngine
from tieredkv.limits import RequestLimits
from tieredkv.policy import CostModel


@dataclass(frozen=True)
class EngineInfo:
    """The engine's resolved config, request limits, KV bytes per block, cost model (None
    without one), its `stats()` right after start-up and the device it runs on, by name."""

    config: EngineConfig
    limits: RequestLimits
    block_bytes: int
    cost_model: CostModel | None
    startup_stats: dict[str, Any]
    device: str

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(engine.config, engine.limits, engine.block_bytes, engine.scheduler.policy.cost, engine.stats(),
                   device_name(engine.runner.device))


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's ("cpu (...)")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cpu_name()})"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
