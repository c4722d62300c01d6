"""Seeded workload generators for experiments (`workload:` in the YAML file).

Each workload is an async program of clients: `await workload.run(client, vocab_size)` sends
requests through `client.request(prompt, max_tokens, tag)` at the times it chooses.

- `multi_turn`: U users hold T-turn conversations sharing a system prompt; each turn's prompt
  is the whole conversation so far plus a new message; users think between turns (and, with a
  `rate`, start their conversations at Poisson arrival times).
- `long_doc_qa`: D documents of L tokens, Q questions each, interleaved so documents fall out
  of the GPU between their questions.
- `preemption_storm`: many long generations that together exceed the GPU KV budget.
- `long_context`: prompts of heavy-tailed lengths (lognormal, clipped, e.g. to 2k-128k tokens),
  part of them starting with one of a few shared documents; Poisson arrivals.
- `replay`: a JSONL trace: `{"time": s, "prompt": [ids] | "text": str, "max_tokens": n}` lines, or
  the Mooncake FAST'25 format (`traces.py`), with a time window, sampling and time scaling.

Arrivals (`rate`): None sends requests at once, a number draws Poisson arrivals at that many
requests (for `multi_turn`: users) per second. The same seed sends the same requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, get_args

from tieredkv.config import check_choice, check_int, unknown_key
from tieredkv.experiment.traces import (
    TraceFormat,
    TraceLine,
    TraceRequest,
    prefix_hit_bound,
    prompt_token_ids,
    read_trace,
    select,
)

FIRST_TOKEN_ID = 4  # ids below are often special tokens


class Client(Protocol):
    async def request(self, prompt: list[int] | str, max_tokens: int, tag: str, returning: bool = False) -> list[int]:
        """Send one request; `returning` marks a prompt that extends one sent before (a later
        turn, another question on a document), whose prefix some tier may still hold."""
        ...


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def _check_fields(workload: Any) -> None:
    for f in dataclasses.fields(workload):
        value = getattr(workload, f.name)
        if f.type in ("int", int) or (f.type == "int | None" and value is not None):
            check_int(f"workload.{f.name}", value, 0 if f.name == "seed" else 1)
        elif f.name.endswith("_s") and value is not None and (not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"workload.{f.name}: expected seconds >= 0, got {value!r}")
    rate = getattr(workload, "rate", None)
    if rate is not None and (not isinstance(rate, (int, float)) or rate <= 0):
        raise ValueError(f"workload.rate: expected requests per second > 0, or null for all at once, got {rate!r}")


def _arrival_times(rng: random.Random, rate: float | None, n: int) -> list[float]:
    """Seconds from the start of `n` Poisson arrivals at `rate` per second (all 0 for None);
    leaves `rng` as it was, so the requests drawn after do not depend on the rate."""
    if rate is None:
        return [0.0] * n
    times, t = [], 0.0
    state = rng.getstate()
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    rng.setstate(state)
    return times


def _clock() -> Callable[[float], Awaitable[None]]:
    """`await at(t)`: sleep until `t` seconds after this call."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def at(when: float) -> None:
        await asyncio.sleep(max(0.0, start + when - loop.time()))

    return at


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Conversations of `turns` turns for `users` users, sharing a system prompt. A user's first
    message has `first_message_tokens` (e.g. a document they paste; default: `message_tokens`);
    users start at once, or at Poisson times, `rate` users per second."""

    users: int = 4
    turns: int = 3
    system_prompt_tokens: int = 64
    message_tokens: int = 24
    first_message_tokens: int | None = None
    max_tokens: int = 16
    think_time_s: float = 0.0
    rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def num_requests(self) -> int:
        return self.users * self.turns

    async def run(self, client: Client, vocab_size: int) -> None:
        rng = random.Random(self.seed)
        system = random_tokens(rng, self.system_prompt_tokens, vocab_size)
        first = self.message_tokens if self.first_message_tokens is None else self.first_message_tokens
        messages = [[random_tokens(rng, first if t == 0 else self.message_tokens, vocab_size)
                     for t in range(self.turns)] for _ in range(self.users)]

        at = _clock()
        arrivals = _arrival_times(rng, self.rate, self.users)

        async def user(u: int) -> None:
            await at(arrivals[u])
            history = list(system)
            for t in range(self.turns):
                history += messages[u][t]
                history += await client.request(list(history), self.max_tokens, f"user{u}/turn{t}", t > 0)
                await asyncio.sleep(self.think_time_s)

        await asyncio.gather(*(user(u) for u in range(self.users)))


@dataclass(frozen=True)
class LongDocQAWorkload:
    """`documents` documents of `document_tokens` tokens, `questions` questions about each,
    asked round-robin over the documents."""

    documents: int = 4
    document_tokens: int = 512
    questions: int = 3
    question_tokens: int = 16
    max_tokens: int = 16
    rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def num_requests(self) -> int:
        return self.documents * self.questions

    async def run(self, client: Client, vocab_size: int) -> None:
        rng = random.Random(self.seed)
        docs = [random_tokens(rng, self.document_tokens, vocab_size) for _ in range(self.documents)]
        prompts = [(f"doc{d}/q{q}", docs[d] + random_tokens(rng, self.question_tokens, vocab_size), q > 0)
                   for q in range(self.questions) for d in range(self.documents)]
        await _send_all(client, prompts, self.max_tokens, rng, self.rate)


@dataclass(frozen=True)
class PreemptionStormWorkload:
    """`requests` long generations arriving together (or at `rate`)."""

    requests: int = 16
    prompt_tokens: int = 256
    max_tokens: int = 256
    rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def num_requests(self) -> int:
        return self.requests

    async def run(self, client: Client, vocab_size: int) -> None:
        rng = random.Random(self.seed)
        prompts = [(f"gen{i}", random_tokens(rng, self.prompt_tokens, vocab_size), False)
                   for i in range(self.requests)]
        await _send_all(client, prompts, self.max_tokens, rng, self.rate)


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
        _check_fields(self)
        if not isinstance(self.time_scale, (int, float)) or isinstance(self.time_scale, bool) or self.time_scale < 0:
            raise ValueError(
                f"workload.time_scale: expected a factor >= 0 (0.5 replays twice as fast), got {self.time_scale!r}"
            )
        if self.rate is not None and self.time_scale != 1.0:
            raise ValueError("workload.rate: set either rate (requests per second) or time_scale, not both")
        if self.speed is not None and (isinstance(self.speed, bool) or not isinstance(self.speed, (int, float))
                                       or not 0 < self.speed < float("inf")):
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
        at = _clock()
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


@dataclass(frozen=True)
class LongContextWorkload:
    """`requests` prompts whose lengths are lognormal (median `median_prompt_tokens`, shape
    `sigma`: 1.0 puts the mean at 1.65x the median and 1% of prompts past 10x it), clipped to
    [`min_prompt_tokens`, `max_prompt_tokens`]. A `shared_fraction` of them ask about one of
    `documents` shared documents: such a prompt is the document's first tokens followed by a
    `question_tokens` question, so two requests on one document share the shorter one's document
    part. Poisson arrivals at `rate` per second (null: all at once); `max_tokens` answers."""

    requests: int = 32
    median_prompt_tokens: int = 8192
    sigma: float = 1.0
    min_prompt_tokens: int = 2048
    max_prompt_tokens: int = 128000
    documents: int = 4
    shared_fraction: float = 0.5
    question_tokens: int = 64
    max_tokens: int = 64
    rate: float | None = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_fields(self)
        if not self.min_prompt_tokens <= self.median_prompt_tokens <= self.max_prompt_tokens:
            raise ValueError(
                f"workload.median_prompt_tokens: {self.median_prompt_tokens} is outside [min_prompt_tokens "
                f"{self.min_prompt_tokens}, max_prompt_tokens {self.max_prompt_tokens}]; widen the range or move it")
        if self.question_tokens >= self.min_prompt_tokens:
            raise ValueError(f"workload.question_tokens: {self.question_tokens} leaves no document in a prompt of "
                             f"min_prompt_tokens {self.min_prompt_tokens}; make it smaller")
        for key, low, high in (("sigma", 0.0, 4.0), ("shared_fraction", 0.0, 1.0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"workload.{key}: expected a number in [{low:g}, {high:g}], got {value!r}")

    @property
    def num_requests(self) -> int:
        return self.requests

    def plan(self, vocab_size: int) -> list[tuple[float, str, list[int], bool]]:
        """Every request as (arrival second, tag, prompt, returning: its document was sent
        before), in arrival order."""
        rng = random.Random(self.seed)
        times = _arrival_times(rng, self.rate, self.requests)
        lengths = [self._length(rng) for _ in range(self.requests)]
        docs = [rng.randrange(self.documents) if rng.random() < self.shared_fraction else None for _ in lengths]
        needed = {d: max(n for n, e in zip(lengths, docs, strict=True) if e == d) for d in set(docs) - {None}}
        text = {d: random_tokens(random.Random(f"{self.seed}/doc{d}"), n, vocab_size) for d, n in needed.items()}
        plan, seen = [], set()
        for i, (t, n, d) in enumerate(zip(times, lengths, docs, strict=True)):
            if d is None:
                plan.append((t, f"req{i}", random_tokens(rng, n, vocab_size), False))
                continue
            question = random_tokens(rng, self.question_tokens, vocab_size)
            plan.append((t, f"req{i}/doc{d}", text[d][: n - self.question_tokens] + question, d in seen))
            seen.add(d)
        return plan

    def _length(self, rng: random.Random) -> int:
        n = round(rng.lognormvariate(math.log(self.median_prompt_tokens), self.sigma))
        return min(max(n, self.min_prompt_tokens), self.max_prompt_tokens)

    async def run(self, client: Client, vocab_size: int) -> None:
        at = _clock()

        async def one(when: float, tag: str, prompt: list[int], returning: bool) -> None:
            await at(when)
            await client.request(prompt, self.max_tokens, tag, returning)

        await asyncio.gather(*(one(*request) for request in self.plan(vocab_size)))


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


async def _send_all(client: Client, prompts: list[tuple[str, list[int], bool]], max_tokens: int,
                    rng: random.Random, rate: float | None) -> None:
    at = _clock()
    times = _arrival_times(rng, rate, len(prompts))

    async def one(when: float, tag: str, prompt: list[int], returning: bool) -> None:
        await at(when)
        await client.request(prompt, max_tokens, tag, returning)

    await asyncio.gather(*(one(t, *request) for t, request in zip(times, prompts, strict=True)))


WORKLOADS: dict[str, type] = {
    "multi_turn": MultiTurnWorkload,
    "long_doc_qa": LongDocQAWorkload,
    "preemption_storm": PreemptionStormWorkload,
    "replay": ReplayWorkload,
    "long_context": LongContextWorkload,
}
Workload = MultiTurnWorkload | LongDocQAWorkload | PreemptionStormWorkload | ReplayWorkload | LongContextWorkload


def make_workload(section: dict[str, Any]) -> Workload:
    """Build the workload named by `section["kind"]` from the rest of its keys."""
    section = dict(section)
    kind = section.pop("kind", "multi_turn")
    if kind not in WORKLOADS:
        raise ValueError(f"workload.kind: {kind!r} is not allowed; choose one of {', '.join(map(repr, WORKLOADS))}")
    cls = WORKLOADS[kind]
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in section:
        if key not in allowed:
            raise ValueError(unknown_key(f"workload.{key}", [f"workload.{k}" for k in allowed]))
    return cls(**section)


def describe_workload(workload: Workload) -> dict[str, Any]:
    """The workload's kind, keys and number of requests (for a replay, the trace as selected)."""
    kind = next(k for k, cls in WORKLOADS.items() if isinstance(workload, cls))
    doc = {"kind": kind, **dataclasses.asdict(workload), "num_requests": workload.num_requests}
    if isinstance(workload, ReplayWorkload):
        doc["trace"] = workload.describe()
    return doc
