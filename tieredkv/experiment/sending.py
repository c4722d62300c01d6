"""What every workload shares: the client its requests go through, the clock it sends them by,
Poisson arrivals, seeded token ids, and the check of its fields.

Operations:
- `Client`: `await client.request(prompt, max_tokens, tag, returning)` sends one request.
- `clock()`: `await at(t)` sleeps until `t` seconds after the call.
- `arrival_times(rng, rate, n)`: Poisson arrivals at `rate` per second (None: all at once);
  `send_all(client, prompts, max_tokens, rng, rate)`: send prompts at such times;
  `send_at(client, plan, max_tokens)`: send each request of a plan at its own second.
- `random_tokens(rng, n, vocab_size)`: seeded token ids (none of the low, often special, ones).
- `check_fields(workload)`: a workload's counts (at most `MAX_COUNT`), token counts (at most
  `MAX_TOKENS`), seconds and rate, checked, and the prompt tokens it draws up front
  (`drawn_tokens`, at most `MAX_DRAWN_TOKENS`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from tieredkv.config import check_int
from tieredkv.values import finite_number

FIRST_TOKEN_ID = 4  # ids below are often special tokens
# Prompts are drawn before the first is sent: bounds far above any real workload, so that a typo
# fails when the file loads rather than filling the memory.
MAX_COUNT = 10**6  # requests, users, turns, documents, questions
MAX_TOKENS = 10**8  # a `*_tokens` field
MAX_DRAWN_TOKENS = 10**8  # all the prompt tokens a workload draws before sending (`drawn_tokens`)


class Client(Protocol):
    async def request(self, prompt: list[int] | str, max_tokens: int, tag: str, returning: bool = False) -> list[int]:
        """Send one request; `returning` marks a prompt that extends one sent before (a later
        turn, another question on a document), whose prefix some tier may still hold."""
        ...


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def check_fields(workload: Any) -> None:
    for f in dataclasses.fields(workload):
        value = getattr(workload, f.name)
        if f.name == "seed":
            check_int("workload.seed", value, 0)
        elif f.type in ("int", int) or (f.type == "int | None" and value is not None):
            check_int(f"workload.{f.name}", value, 1, MAX_TOKENS if f.name.endswith("_tokens") else MAX_COUNT)
        elif f.name.endswith("_s") and value is not None and not finite_number(value, 0.0, inclusive=True):
            raise ValueError(f"workload.{f.name}: expected a finite number of seconds >= 0, got {value!r}")
    rate = getattr(workload, "rate", None)
    if rate is not None and not finite_number(rate, 0.0, inclusive=False):
        raise ValueError(f"workload.rate: expected requests per second > 0, or null for all at once, got {rate!r}")
    drawn = getattr(workload, "drawn_tokens", None)  # (a replay's are its file's)
    if drawn is not None and drawn > MAX_DRAWN_TOKENS:
        raise ValueError(f"workload: {drawn:,} prompt tokens to draw before the first request is sent, more than "
                         f"{MAX_DRAWN_TOKENS:,}; make fewer requests or shorter prompts")


def arrival_times(rng: random.Random, rate: float | None, n: int) -> list[float]:
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


def clock() -> Callable[[float], Awaitable[None]]:
    """`await at(t)`: sleep until `t` seconds after this call."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def at(when: float) -> None:
        await asyncio.sleep(max(0.0, start + when - loop.time()))

    return at


async def send_all(client: Client, prompts: list[tuple[str, list[int], bool]], max_tokens: int,
                   rng: random.Random, rate: float | None) -> None:
    """Send `(tag, prompt, returning)` requests at `arrival_times` drawn from `rng`."""
    times = arrival_times(rng, rate, len(prompts))
    await send_at(client, [(t, *request) for t, request in zip(times, prompts, strict=True)], max_tokens)


async def send_at(client: Client, plan: list[tuple[float, str, list[int], bool]], max_tokens: int) -> None:
    """Send each `(second, tag, prompt, returning)` request that many seconds from now."""
    at = clock()

    async def one(when: float, tag: str, prompt: list[int], returning: bool) -> None:
        await at(when)
        await client.request(prompt, max_tokens, tag, returning)

    await asyncio.gather(*(one(*request) for request in plan))
