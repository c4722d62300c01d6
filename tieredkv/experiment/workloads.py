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
- `replay` (`replay.py`): a JSONL trace: `{"time": s, "prompt": [ids] | "text": str,
  "max_tokens": n}` lines, or the Mooncake FAST'25 format (`traces.py`), with a time window,
  sampling and time scaling.
`make_workload(section)` builds one from its YAML keys; `describe_workload(workload)` says what it
was, for result.json. A generated workload draws its prompts before it sends the first
(`drawn_tokens`: how many tokens, at most; bounded by `sending.check_fields`). What they share
(the client, the clock, arrivals) is `sending.py`'s.

Arrivals (`rate`): None sends requests at once, a number draws Poisson arrivals at that many
requests (for `multi_turn`: users) per second. The same seed sends the same requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

from tieredkv.config import unknown_key
from tieredkv.experiment.replay import ReplayWorkload
from tieredkv.experiment.sending import Client, arrival_times, check_fields, clock, random_tokens, send_all, send_at


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
        check_fields(self)

    @property
    def num_requests(self) -> int:
        return self.users * self.turns

    @property
    def drawn_tokens(self) -> int:
        first = self.message_tokens if self.first_message_tokens is None else self.first_message_tokens
        return self.system_prompt_tokens + self.users * (first + (self.turns - 1) * self.message_tokens)

    def messages(self, rng: random.Random, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
        """The system prompt, and each user's messages turn by turn, drawn from `rng`."""
        system = random_tokens(rng, self.system_prompt_tokens, vocab_size)
        first = self.message_tokens if self.first_message_tokens is None else self.first_message_tokens
        return system, [[random_tokens(rng, first if t == 0 else self.message_tokens, vocab_size)
                         for t in range(self.turns)] for _ in range(self.users)]

    async def run(self, client: Client, vocab_size: int) -> None:
        rng = random.Random(self.seed)
        system, messages = self.messages(rng, vocab_size)
        at = clock()
        arrivals = arrival_times(rng, self.rate, self.users)

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
        check_fields(self)

    @property
    def num_requests(self) -> int:
        return self.documents * self.questions

    @property
    def drawn_tokens(self) -> int:
        return self.num_requests * (self.document_tokens + self.question_tokens)

    def plan(self, vocab_size: int) -> list[tuple[float, str, list[int], bool]]:
        """Every request as (arrival second, tag, prompt, returning: its document was asked
        about before), in arrival order."""
        rng = random.Random(self.seed)
        docs = [random_tokens(rng, self.document_tokens, vocab_size) for _ in range(self.documents)]
        prompts = [(f"doc{d}/q{q}", docs[d] + random_tokens(rng, self.question_tokens, vocab_size), q > 0)
                   for q in range(self.questions) for d in range(self.documents)]
        times = arrival_times(rng, self.rate, len(prompts))
        return [(t, *prompt) for t, prompt in zip(times, prompts, strict=True)]

    async def run(self, client: Client, vocab_size: int) -> None:
        await send_at(client, self.plan(vocab_size), self.max_tokens)


@dataclass(frozen=True)
class PreemptionStormWorkload:
    """`requests` long generations arriving together (or at `rate`)."""

    requests: int = 16
    prompt_tokens: int = 256
    max_tokens: int = 256
    rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def num_requests(self) -> int:
        return self.requests

    @property
    def drawn_tokens(self) -> int:
        return self.requests * self.prompt_tokens

    async def run(self, client: Client, vocab_size: int) -> None:
        rng = random.Random(self.seed)
        prompts = [(f"gen{i}", random_tokens(rng, self.prompt_tokens, vocab_size), False)
                   for i in range(self.requests)]
        await send_all(client, prompts, self.max_tokens, rng, self.rate)


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
        check_fields(self)
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

    @property
    def drawn_tokens(self) -> int:
        """At most (prompt lengths are drawn with the requests)."""
        return self.requests * self.max_prompt_tokens

    def plan(self, vocab_size: int) -> list[tuple[float, str, list[int], bool]]:
        """Every request as (arrival second, tag, prompt, returning: its document was sent
        before), in arrival order."""
        rng = random.Random(self.seed)
        times = arrival_times(rng, self.rate, self.requests)
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
        await send_at(client, self.plan(vocab_size), self.max_tokens)


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
    if not isinstance(kind, str) or kind not in WORKLOADS:
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
