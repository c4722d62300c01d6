"""Where `AsyncLLM`'s engine loop runs, and what its front end knows of the engine.

Modules: `info` (`EngineInfo`: the engine's facts, fixed at start-up), `thread` (the loop in a
thread of this process), `process` (the loop in an engine process of its own: this side),
`child` (that process's main loop), `messages` (what the two processes send each other),
`deltas` (each step's outputs as per-request deltas, and the outputs rebuilt from them).

Both loops take the same calls from the event loop (`add`, `abort`, `call` (an engine method
between two steps), `stats`, `drained`, `close`) and hand every step's outputs to an
`OutputSink` in one call on the event loop.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from tieredkv.outputs import RequestOutput
from tieredkv.sampling import SamplingParams


class NewRequest(NamedTuple):
    """A request for the engine under its engine id, checked against the engine's limits;
    `arrival_time`: when the front end took it (`time.monotonic()`), where its TTFT starts."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class OutputSink(Protocol):
    """Where an engine loop hands what it produces; called on the event loop only."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs (under the engine's request ids)."""

    def fail(self, request_id: str | None, err: BaseException) -> None:
        """A request failed (None: every request the engine has)."""
