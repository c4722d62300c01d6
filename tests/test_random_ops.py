"""Randomized operations (hypothesis) over `LLMEngine` and `AsyncLLM` with preemption forced:
add, step, abort, reset the prefix cache, cancel and retry under the same request id.

Every request that finishes on its own must carry exactly the greedy tokens transformers gives
for its prompt alone; an aborted one a prefix of them. None may be lost (every request ends, once)
and, when all have ended, no GPU or CPU block may be held (cached-only blocks are free).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reference import make_prompts, settle_writes
from tieredkv import AsyncLLM, EngineConfig, LLMEngine, SamplingParams

PROMPTS = make_prompts(vocab_size=512)  # lengths 1 to 70, several sharing a 37-token prefix
MAX_TOKENS = 12
IDS = [f"r{i}" for i in range(5)]  # few ids, so that they are reused while live
# 21 blocks of 4 tokens: the longest request (70 + 12 tokens) takes them all, so requests preempt each
# other; the CPU tier holds 12 blocks, so some swaps fall back to recompute.
ENGINE = dict(model="tiny-llama", block_size=4, num_gpu_blocks=21, max_num_batched_tokens=16,
              max_num_seqs=4, cpu_cache_bytes=12 * 2048)
SETTINGS = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

requests = st.tuples(st.sampled_from(IDS), st.integers(0, len(PROMPTS) - 1), st.integers(1, MAX_TOKENS))
adds = st.tuples(st.just("add"), requests)
ops = st.tuples(
    st.lists(adds, min_size=4, max_size=8),  # a burst first, so that requests compete for blocks
    st.lists(
        st.one_of(
            adds, adds,
            st.tuples(st.just("step"), st.integers(1, 6)),
            st.tuples(st.just("abort"), st.sampled_from(IDS)),
            st.tuples(st.just("reset"), st.none()),
            st.tuples(st.just("retry"), requests),
        ),
        min_size=4, max_size=20,
    ),
).map(lambda parts: parts[0] + parts[1])


@pytest.fixture(scope="module")
def expected(reference_outputs):
    return reference_outputs("tiny-llama", PROMPTS, MAX_TOKENS)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def assert_nothing_held(engine: LLMEngine) -> None:
    engine.kv.offload.drain()  # a finished demotion holds its CPU blocks until a step retires it
    # a store's read still in flight for an ended request holds its CPU block until it lands: the
    # engine's loop tends the tiers between requests until none is, and so does this
    stats = settle_writes(engine)
    assert stats["gpu_blocks_used"] == 0, stats
    assert stats["cpu_blocks_used"] == 0, stats
    assert not engine.has_unfinished() and not engine.seqs
    assert not engine.scheduler.swapped


def assert_ended_right(out, want: list[int]) -> None:
    """A finished output: its own greedy tokens, or a prefix of them if it was aborted."""
    assert out.finished
    if out.finish_reason == "abort":
        assert out.token_ids == want[: len(out.token_ids)]
    else:
        assert out.finish_reason in ("length", "stop") and out.token_ids == want


# ---------------------------------------------------------------- LLMEngine


@dataclass
class EngineRun:
    """Drives an `LLMEngine` and checks every output against the reference."""

    engine: LLMEngine
    expected: list[list[int]]
    live: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # id -> (want, seen)
    ended: int = 0

    def add(self, rid: str, prompt: int, max_tokens: int) -> None:
        if rid in self.live:
            with pytest.raises(ValueError, match="already in use"):
                self.engine.add_request(PROMPTS[prompt], params(max_tokens), rid)
            return
        self.engine.add_request(PROMPTS[prompt], params(max_tokens), rid)
        self.live[rid] = (self.expected[prompt][:max_tokens], [])

    def step(self) -> None:
        for out in self.engine.step():
            want, seen = self.live[out.request_id]  # KeyError: an output for no live request
            assert out.token_ids[:-1] == seen, "each output extends the last by one token"
            seen.append(out.token_ids[-1])
            if out.finished:
                assert_ended_right(out, want)
                self.end(out.request_id)

    def abort(self, rid: str) -> None:
        out = self.engine.abort(rid)
        assert (out is not None) == (rid in self.live)
        if out is not None:
            assert out.finish_reason == "abort"
            assert_ended_right(out, self.live[rid][0])
            self.end(rid)

    def end(self, rid: str) -> None:
        del self.live[rid]
        self.ended += 1

    def drain(self) -> None:
        for _ in range(2000):
            if not self.engine.has_unfinished():
                break
            self.step()
        assert not self.live, f"requests never finished: {sorted(self.live)}"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """One store for every example: each engine finds what the ones before it wrote, and loads it."""
    return str(tmp_path_factory.mktemp("store"))


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@SETTINGS
@given(ops=ops)
def test_random_engine_ops(expected, preemption, ops):
    run_engine_ops(LLMEngine(EngineConfig.from_kwargs(**ENGINE, preemption=preemption)), expected, ops)


@settings(SETTINGS, max_examples=12)
@given(ops=ops)
def test_random_engine_ops_with_a_store(expected, store_path, ops):
    """The same with a store below the CPU tier: loads from it, spills to it, swaps that take the
    blocks held for loads of prompts still waiting."""
    config = EngineConfig.from_kwargs(**ENGINE, preemption="swap", nvme_path=store_path, nvme_bytes=4 << 20)
    run_engine_ops(LLMEngine(config), expected, ops)


def run_engine_ops(engine: LLMEngine, expected: list[list[int]], ops) -> None:
    with engine:  # closed even when a check fails: the next example (or a replay) opens the same store
        run = EngineRun(engine, expected)
        added = 0
        for kind, arg in ops:
            if kind == "add":
                added += arg[0] not in run.live
                run.add(*arg)
            elif kind == "step":
                for _ in range(arg):
                    run.step()
            elif kind == "abort":
                run.abort(arg)
            elif kind == "reset":
                engine.reset_prefix_cache()
            else:  # cancel and retry under the same id
                run.abort(arg[0])
                run.add(*arg)
                added += 1
        run.drain()
        assert run.ended == added  # every request ended exactly once
        assert_nothing_held(engine)


# ---------------------------------------------------------------- AsyncLLM


@dataclass
class Stream:
    """One consumer task and what it saw."""

    want: list[int]
    outputs: list = field(default_factory=list)
    rejected: bool = False


class AsyncRun:
    """Drives an `AsyncLLM` from concurrent consumer tasks."""

    def __init__(self, allm: AsyncLLM, expected: list[list[int]]) -> None:
        self.allm = allm
        self.expected = expected
        self.tasks: dict[str, list[tuple[asyncio.Task, Stream, bool]]] = {rid: [] for rid in IDS}

    def start(self, rid: str, prompt: int, max_tokens: int) -> None:
        stream = Stream(self.expected[prompt][:max_tokens])
        rival = any(not task.done() for task, _, _ in self.tasks[rid])
        task = asyncio.create_task(self._consume(rid, PROMPTS[prompt], max_tokens, stream))
        self.tasks[rid].append((task, stream, rival))

    async def _consume(self, rid: str, prompt: list[int], max_tokens: int, stream: Stream) -> None:
        try:
            async for out in self.allm.generate_stream(prompt, params(max_tokens), request_id=rid):
                assert out.request_id == rid
                stream.outputs.append(out)
        except ValueError as err:
            assert "already in use" in str(err)
            stream.rejected = True

    def cancel_and_retry(self, rid: str, prompt: int, max_tokens: int) -> None:
        for task, _, _ in self.tasks[rid]:
            task.cancel()
        self.start(rid, prompt, max_tokens)
        self.tasks[rid][-1] = (*self.tasks[rid][-1][:2], False)  # the retry has no rival left

    async def finish(self) -> None:
        everything = [task for tasks in self.tasks.values() for task, _, _ in tasks]
        await asyncio.wait_for(asyncio.gather(*everything, return_exceptions=True), timeout=120)
        for tasks in self.tasks.values():
            for task, stream, rival in tasks:
                self._check(task, stream, rival)

    @staticmethod
    def _check(task: asyncio.Task, stream: Stream, rival: bool) -> None:
        if task.cancelled():
            return
        assert task.exception() is None, task.exception()
        if stream.rejected:
            assert rival, "rejected although no stream with its id was open"
            return
        seen: list[int] = []
        for out in stream.outputs[:-1]:
            assert not out.finished and out.token_ids[:-1] == seen
            seen = out.token_ids
        assert_ended_right(stream.outputs[-1], stream.want)  # IndexError: a stream with no output


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@SETTINGS
@given(ops=ops)
def test_random_async_ops(expected, preemption, ops):
    async def main() -> None:
        allm = AsyncLLM(config=EngineConfig.from_kwargs(**ENGINE, preemption=preemption))
        run = AsyncRun(allm, expected)
        for kind, arg in ops:
            if kind == "add":
                run.start(*arg)
            elif kind == "step":
                await asyncio.sleep(0.01 * arg)  # the loop steps meanwhile
            elif kind == "abort":
                allm.abort(arg)
            elif kind == "reset":
                await allm.reset_prefix_cache()
            else:
                run.cancel_and_retry(*arg)
        await run.finish()
        await allm.drained()
        assert_nothing_held(allm.engine)
        await allm.close()

    asyncio.run(main())
