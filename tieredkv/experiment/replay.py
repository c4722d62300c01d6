"""`workload.kind: replay`: requests read from a JSONL trace (`traces.py`: this project's prompts
format or the Mooncake FAST'25 format), selected and sent at their times.

Operations:
- `ReplayWorkload(path, ...)`: the selection (time window, fraction of conversations, limits) and
  the time scaling; `requests` (the file is read once per version of it, `_read_trace`),
  `describe()`, `run(client, vocab_size)`.
"""

from __future__ import annotations

import asyncio
import functools
import os
from dataclasses import dataclass
from typing import Any, get_args

from tieredkv.config import check_choice
from tieredkv.experiment.sending import Client, check_fields, clock
from tieredkv.experiment.traces import (
    TraceFormat,
    TraceLine,
    TraceRequest,
    prefix_hit_bound,
    prompt_token_ids,
    read_trace,
    select,
)
from tieredkv.values import finite_number


@dataclass(frozen=True)
class ReplayWorkload:
    """Requests read from a JSONL trace (`traces.py`: this project's prompts format or the
    Mooncake FAST'25 format), sent at their times.

    Selection: lines in [`start_s`, `start_s + duration_s`) of the trace's clock, a seeded
    `fraction` of its conversations, prompts of at most `max_input_tokens`, the first
    `max_requests`. Times start at 0 and are multiplied by `time_scale` (0.5: twice as fast), or
    divided by `speed` (2: twice as fast; the load a sweep raises), or scaled so that requests
    arrive `rate` per second on average. Outputs are capped at
    `max_output_tokens`; `max_tokens` is for prompts lines that do not say. A Mooncake hash id
    stands for `block_tokens` tokens drawn from `seed`."""

    path: str = ""
    format: TraceFormat = "auto"
    max_tokens: int = 16
    max_output_tokens: int | None = None
    time_scale: float = 1.0
    speed: float | None = None
    rate: float | None = None
    start_s: float = 0.0
    duration_s: float | None = None
    fraction: float = 1.0
    max_requests: int | None = None
    max_input_tokens: int | None = None
    block_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.path or not isinstance(self.path, str):
            raise ValueError("workload.path: a replay needs the JSONL file of requests")
        check_choice("workload.format", self.format, get_args(TraceFormat))
        check_fields(self)
        if not finite_number(self.time_scale, 0.0, inclusive=True):
            raise ValueError(
                f"workload.time_scale: expected a factor >= 0 (0.5 replays twice as fast), got {self.time_scale!r}"
            )
        if self.rate is not None and self.time_scale != 1.0:
            raise ValueError("workload.rate: set either rate (requests per second) or time_scale, not both")
        if self.speed is not None and not finite_number(self.speed, 0.0, inclusive=False):
            raise ValueError(f"workload.speed: expected a factor > 0 (2 replays twice as fast), got {self.speed!r}")
        if self.speed is not None and (self.rate is not None or self.time_scale != 1.0):
            raise ValueError("workload.speed: set either speed or rate / time_scale, not both "
                             "(speed 2 is time_scale 0.5)")
        if not isinstance(self.fraction, (int, float)) or isinstance(self.fraction, bool) or not 0 < self.fraction <= 1:
            raise ValueError(
                f"workload.fraction: expected a fraction of conversations in (0, 1], got {self.fraction!r}"
            )

    @functools.cached_property
    def requests(self) -> list[TraceRequest]:
        """The selected requests (the file is read and checked once)."""
        return self._trace[1]

    @functools.cached_property
    def _trace(self) -> tuple[list[TraceLine], list[TraceRequest]]:
        lines = _read_trace(self.path, self.format, self.block_tokens)
        selected = select(
            lines, block_tokens=self.block_tokens, start_s=self.start_s, duration_s=self.duration_s,
            fraction=self.fraction, max_requests=self.max_requests, max_input_tokens=self.max_input_tokens,
            time_scale=self.time_scale if self.speed is None else 1 / self.speed, rate=self.rate, seed=self.seed,
        )
        if not selected:
            raise ValueError(f"workload: no line of {self.path} is selected; widen the window, fraction or limits")
        return lines, selected

    def describe(self) -> dict[str, Any]:
        """The trace as replayed: its format, lines read and sent, returning ones, arrival span."""
        lines, selected = self._trace
        span = selected[-1].time_s
        return {
            "format": "mooncake" if lines[0].hash_ids else "prompts", "lines": len(lines),
            "requests": len(selected), "returning": sum(r.returning for r in selected),
            "conversations": len({r.conversation for r in selected}), "span_s": span,
            "offered_rate": (len(selected) - 1) / span if span > 0 else None,
            "prompt_tokens": sum(r.line.num_prompt_tokens or 0 for r in selected),
            "prefix_hit_bound": prefix_hit_bound([r.line for r in selected], self.block_tokens)
            if lines[0].hash_ids else None,
        }

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def output_tokens(self, request: TraceRequest) -> int:
        n = request.line.output_tokens or self.max_tokens
        return n if self.max_output_tokens is None else min(n, self.max_output_tokens)

    async def run(self, client: Client, vocab_size: int) -> None:
        at = clock()
        blocks: dict[int, list[int]] = {}

        async def one(request: TraceRequest) -> None:
            line = request.line
            if line.hash_ids:
                prompt = prompt_token_ids(line, self.block_tokens, vocab_size, self.seed, blocks)
            else:
                prompt = list(line.prompt) if isinstance(line.prompt, tuple) else line.prompt
            await at(request.time_s)
            await client.request(prompt, self.output_tokens(request), f"line{line.line}", request.returning)

        await asyncio.gather(*(one(r) for r in self.requests))


def _read_trace(path: str, fmt: TraceFormat, block_tokens: int) -> list[TraceLine]:
    """`read_trace`, once per file version (every load point of a sweep replays the same file)."""
    try:
        st = os.stat(path)
    except OSError:
        return read_trace(path, fmt, block_tokens)  # which says what is wrong
    return _read_trace_version(path, fmt, block_tokens, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read_trace_version(path: str, fmt: TraceFormat, block_tokens: int, mtime_ns: int, size: int) -> list[TraceLine]:
    return read_trace(path, fmt, block_tokens)
