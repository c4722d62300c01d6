"""The engine loop between requests: with no request left it tends the tiers while their I/O
goes on and stops once it is done; the thread stops at once when `drained` is awaited, the
engine process's loop when it is told to shut down. The engine here is a stand-in that only
counts the calls the loop makes (the tiers' side is tested in `test_slow_tier.py`)."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import threading
import time

from tieredkv.engine_core import NewRequest
from tieredkv.engine_core.child import EngineLoop
from tieredkv.engine_core.messages import Shutdown
from tieredkv.engine_core.thread import ThreadCore
from tieredkv.sampling import SamplingParams


class TendingEngine:
    """One step per request; then `tend_tiers` says I/O is in flight `busy_tends` times."""

    def __init__(self, busy_tends: int, tend_again_s: float = 0.005) -> None:
        self.busy_tends = busy_tends
        self.tend_again_s = tend_again_s
        self.tends = 0
        self.steps = 0
        self._unfinished = 0

    def add_request(self, prompt, params, request_id, arrival_time) -> None:
        self._unfinished += 1

    def has_unfinished(self) -> bool:
        return self._unfinished > 0

    def step(self) -> list:
        self.steps += 1
        self._unfinished = 0
        return []

    def tend_tiers(self) -> float | None:
        self.tends += 1
        return self.tend_again_s if self.tends <= self.busy_tends else None


class Sink:
    def deliver(self, outputs) -> None:
        pass

    def fail(self, request_id, err) -> None:
        raise AssertionError(err)


def request(i: int) -> NewRequest:
    return NewRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1), time.monotonic())


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def test_after_the_last_request_the_thread_tends_the_tiers_until_their_io_is_done():
    engine = TendingEngine(busy_tends=5)
    core = ThreadCore(engine, Sink())
    core.add(request(0))
    await wait_for(lambda: engine.tends == 6)  # five calls while busy, one that finds it done
    await asyncio.sleep(0.05)
    assert engine.tends == 6 and engine.steps == 1  # then it stopped, with no request
    core.add(request(1))  # a later request starts the thread again, and tending after it
    await wait_for(lambda: engine.steps == 2 and engine.tends == 7)
    await core.drained()


async def test_drained_stops_the_tending_at_once():
    engine = TendingEngine(busy_tends=10**9)  # I/O that never ends (a disk that hangs)
    core = ThreadCore(engine, Sink())
    core.add(request(0))
    await wait_for(lambda: engine.tends >= 3)
    start = time.monotonic()
    await core.drained()
    assert time.monotonic() - start < 1.0
    tends = engine.tends
    await asyncio.sleep(0.05)
    assert engine.tends == tends  # the thread is gone


async def test_a_request_handed_over_while_the_thread_tends_is_taken_at_once():
    engine = TendingEngine(busy_tends=10**9, tend_again_s=30.0)  # a tending pause far longer than the test
    core = ThreadCore(engine, Sink())
    core.add(request(0))
    await wait_for(lambda: engine.tends >= 1)  # the thread is in its tending pause
    core.add(request(1))
    await wait_for(lambda: engine.steps == 2, timeout_s=5.0)  # woken by the hand-over
    await core.drained()


def test_the_engine_process_loop_tends_the_tiers_between_requests_too():
    engine = TendingEngine(busy_tends=5)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    ours, theirs = multiprocessing.Pipe()
    loop = threading.Thread(target=EngineLoop(engine, theirs, inbox).run, daemon=True)
    loop.start()
    inbox.put(request(0))
    deadline = time.monotonic() + 5.0
    while engine.tends < 6:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    time.sleep(0.05)
    assert engine.tends == 6 and engine.steps == 1  # done: it waits for the next message
    inbox.put(Shutdown())
    loop.join(timeout=5.0)
    assert not loop.is_alive()
    ours.close()
