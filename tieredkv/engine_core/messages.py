"""What the server and its engine process say to each other over their connection (pickled).

To the engine: `NewRequest`, `Abort`, `Call` (an `LLMEngine` method named by `CallName`, run
between two steps), `Shutdown`.
From it: `Ready` (or `StartFailed`) once, then `StepOutputs` (one per step: every request's
delta), `Rejected` (a request the engine refused), `Reply` (to a `Call`), `StepFailed`, and
`Closed` last, once the engine has released its tiers after a `Shutdown`.
"""

from __future__ import annotations

import pickle
from typing import Any, Literal, NamedTuple

from tieredkv.engine_core.deltas import OutputDelta
from tieredkv.engine_core.info import EngineInfo

CallName = Literal["stats", "reset_prefix_cache", "trace_cpu_tier", "cpu_tier_replay"]


class Abort(NamedTuple):
    request_id: str


class Call(NamedTuple):
    call_id: int
    name: CallName


class Shutdown(NamedTuple):
    """Release the tiers and exit (the server sends it once its requests have ended)."""


class Ready(NamedTuple):
    info: EngineInfo


class StartFailed(NamedTuple):
    error: BaseException


class StepOutputs(NamedTuple):
    deltas: list[OutputDelta]


class Rejected(NamedTuple):
    request_id: str
    error: BaseException


class Reply(NamedTuple):
    call_id: int
    value: Any
    error: BaseException | None = None


class Closed(NamedTuple):
    """The engine released its tiers; its `stats()` then (what closing wrote down included)."""

    stats: dict[str, Any]


class StepFailed(NamedTuple):
    """A step raised: every unfinished request fails with `error`."""

    error: BaseException


def portable(err: BaseException) -> BaseException:
    """`err` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err
