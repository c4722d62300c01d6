"""AsyncLLM: streaming order, abort at every stage, cancellation, many concurrent requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.reference import make_prompts
from tieredkv import AsyncLLM, EngineConfig, LLMEngine, SamplingParams
from tieredkv.async_engine import MAX_UNREAD_OUTPUTS, Mailbox
from tieredkv.outputs import RequestOutput

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def assert_nothing_held(allm: AsyncLLM) -> None:
    stats = allm.stats()
    assert stats["gpu_blocks_used"] == 0
    assert stats.get("cpu_blocks_used", 0) == 0
    assert stats["requests_running"] == stats["requests_waiting"] == 0
    assert not allm.engine.scheduler.swapped and not allm.engine.seqs
    assert not allm.engine.kv.keys._runs  # the prefix runs remembered for sequences went with them


async def test_stream_matches_transformers(reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, 40)
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=30, max_num_batched_tokens=24,
                    cpu_cache_bytes="256KiB", preemption="swap")

    async def collect(prompt):
        seen = []
        async for out in allm.generate_stream(prompt, SamplingParams(max_tokens=40, temperature=0.0)):
            # every output extends the previous one by exactly one token
            assert out.token_ids[: len(seen)] == seen and len(out.token_ids) == len(seen) + 1
            seen = out.token_ids
        assert out.finished
        return seen

    results = await asyncio.gather(*(collect(p) for p in prompts))
    assert results == expected
    assert allm.stats()["preemptions"]["swap"] > 0
    assert_nothing_held(allm)
    await allm.close()


async def test_leaving_the_stream_early_aborts():
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    async for out in allm.generate_stream(list(range(5, 30)), GREEDY):
        if len(out.token_ids) == 3:
            break
    await asyncio.sleep(0)
    await allm.drained()
    assert_nothing_held(allm)
    await allm.close()


async def test_abort_mid_prefill():
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8)
    outputs = []

    async def consume():
        async for out in allm.generate_stream(list(range(5, 105)), GREEDY, request_id="long"):
            outputs.append(out)

    task = asyncio.create_task(consume())
    while allm.engine.stats()["prefill_tokens"] < 16:  # a few 8-token chunks are in
        await asyncio.sleep(0.001)
    allm.abort("long")
    await asyncio.wait_for(task, timeout=30)  # the stream ends: the consumer is not left waiting
    [last] = outputs  # no token was produced, only the final output
    assert last.finished and last.finish_reason == "abort" and last.token_ids == []
    assert last.request_id == "long"
    await allm.drained()
    assert_nothing_held(allm)


async def test_abort_ends_an_open_stream_with_the_tokens_so_far(reference_outputs):
    prompt = list(range(5, 30))
    expected = reference_outputs("tiny-llama", [prompt], 24)[0]
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    outputs = []

    async def consume():
        async for out in allm.generate_stream(prompt, GREEDY, request_id="r"):
            outputs.append(out)
            if len(out.token_ids) == 3:
                allm.abort("r")

    await asyncio.wait_for(consume(), timeout=30)
    last = outputs[-1]
    assert last.finished and last.finish_reason == "abort"
    assert last.token_ids == expected[: len(last.token_ids)] and len(last.token_ids) >= 3
    await allm.drained()
    assert_nothing_held(allm)
    await allm.close()


async def test_close_ends_every_open_stream():
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    params = SamplingParams(max_tokens=200, temperature=0.0)
    lasts = {}

    async def consume(prompt, rid):
        async for out in allm.generate_stream(prompt, params, request_id=rid):
            lasts[rid] = out

    tasks = [asyncio.create_task(consume(list(range(5, 40)), "a")),
             asyncio.create_task(consume(list(range(50, 60)), "b"))]
    while allm.engine.stats()["decode_tokens"] < 4:
        await asyncio.sleep(0.001)
    await asyncio.wait_for(allm.close(), timeout=30)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    assert {rid: out.finish_reason for rid, out in lasts.items()} == {"a": "abort", "b": "abort"}
    assert all(out.finished for out in lasts.values())
    assert_nothing_held(allm)
    with pytest.raises(RuntimeError, match="AsyncLLM is closed"):
        await allm.generate([5, 6], GREEDY)
    await allm.close()  # closing twice is harmless


async def test_abort_while_swapped():
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=30, max_num_batched_tokens=24,
                    cpu_cache_bytes="256KiB", preemption="swap")
    prompts = make_prompts(vocab_size=512)
    tasks = [asyncio.create_task(allm.generate(p, SamplingParams(max_tokens=40, temperature=0.0))) for p in prompts]
    while not allm.engine.scheduler.swapped:
        await asyncio.sleep(0.001)
    victim = allm.engine.scheduler.swapped[0]
    assert allm.engine.kv.swap._blocks[victim.seq_id]  # it holds CPU blocks
    index = [t for t in tasks if not t.done()]
    for task in index:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await allm.drained()
    assert_nothing_held(allm)
    await allm.close()


async def test_cancelled_task_frees_its_request():
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    task = asyncio.create_task(allm.generate(list(range(5, 40)), SamplingParams(max_tokens=200, temperature=0.0)))
    while allm.engine.stats()["decode_tokens"] < 3:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await allm.drained()
    assert_nothing_held(allm)


async def test_bad_request_raises_and_others_continue():
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    good = asyncio.create_task(allm.generate([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0)))
    with pytest.raises(ValueError, match="prompt: is empty"):
        await allm.generate([], GREEDY)
    assert len((await good).token_ids) == 5


async def test_a_thousand_concurrent_requests():
    allm = AsyncLLM(model="tiny-llama", block_size=16, num_gpu_blocks=512, max_num_seqs=256)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = await asyncio.gather(*(allm.generate([5 + i % 400, 9, 11 + i % 7], params) for i in range(1000)))
    assert all(len(o.token_ids) == 3 and o.finished for o in outs)
    # identical prompts give identical greedy outputs
    by_prompt: dict[tuple, list[int]] = {}
    for i, o in enumerate(outs):
        key = (5 + i % 400, 11 + i % 7)
        assert by_prompt.setdefault(key, o.token_ids) == o.token_ids
    assert_nothing_held(allm)
    await allm.close()


class SlowEngine(LLMEngine):
    """An engine whose every step takes at least 50 ms, so the asyncio side reliably acts
    while a step is in flight."""

    def step(self):
        time.sleep(0.05)
        return super().step()


def slow_async_llm(**kwargs) -> AsyncLLM:
    allm = AsyncLLM(model="tiny-llama", **kwargs)
    allm.engine = SlowEngine(allm.engine.config)
    return allm


async def test_cancel_and_retry_with_the_same_request_id(reference_outputs):
    prompts = make_prompts(vocab_size=512)
    first, retry, neighbour = prompts[1], prompts[2], prompts[6]
    expected = reference_outputs("tiny-llama", [retry, neighbour], 12)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    allm = slow_async_llm(block_size=4, num_gpu_blocks=64)
    other = asyncio.create_task(allm.generate(neighbour, params))
    while allm.stats()["steps"] < 1:  # the loop is stepping
        await asyncio.sleep(0.001)

    async def tokens(prompt):
        outputs = [out async for out in allm.generate_stream(prompt, params, request_id="r")]
        return outputs[-1].token_ids

    cancelled = asyncio.create_task(tokens(first))
    await asyncio.sleep(0.005)  # queued for the next step, not yet in the engine
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    retried = await asyncio.wait_for(tokens(retry), timeout=60)
    assert retried == expected[0]  # its own tokens, not the cancelled request's
    assert (await other).token_ids == expected[1]
    await allm.drained()
    assert_nothing_held(allm)
    await allm.close()


async def test_a_live_request_id_is_rejected_until_it_ends():
    allm = slow_async_llm(block_size=4, num_gpu_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = asyncio.create_task(allm.generate_stream([5, 6, 7], params, request_id="r").__anext__())
    await asyncio.sleep(0.005)  # pending for the next step
    with pytest.raises(ValueError, match="request_id: 'r' is already in use"):
        await allm.generate_stream([8, 9], params, request_id="r").__anext__()
    await first
    await allm.close()


@pytest.mark.parametrize("request_id", [[1], 5])
async def test_a_request_id_that_is_not_a_string_is_a_value_error(request_id):
    """As in `LLM.add_request`; a list raised TypeError, a number was taken (and named another id)."""
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    message = f"request_id: expected a string, got {type(request_id).__name__}"
    with pytest.raises(ValueError, match=message):
        await allm.generate_stream([5], GREEDY, request_id).__anext__()
    with pytest.raises(ValueError, match=message):
        allm.abort(request_id)
    assert len((await allm.generate([5, 6], SamplingParams(max_tokens=3))).token_ids) == 3
    await allm.close()

def test_engine_rejects_a_duplicate_request_id_at_enqueue():
    engine = LLMEngine(EngineConfig.from_kwargs(model="tiny-llama", block_size=4, num_gpu_blocks=16))
    one = engine.make_sequence([5, 6, 7], request_id="x")
    two = engine.make_sequence([8, 9], request_id="x")
    engine.enqueue(one)
    with pytest.raises(ValueError, match="request_id: 'x' is already in use"):
        engine.enqueue(two)
    assert engine.seqs["x"] is one


async def test_the_engine_steps_while_the_event_loop_is_busy():
    """The engine loop does not wait for the event loop between steps: while a callback holds
    the event loop (a web server busy sending), the engine goes on stepping; the outputs of
    those steps are waiting for the stream when the event loop is free again."""
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    stream = allm.generate_stream(list(range(5, 30)), params)
    first = await anext(stream)
    assert len(first.token_ids) == 1
    steps = allm.engine.stats()["steps"]
    deadline = time.monotonic() + 10
    while allm.engine.stats()["steps"] < steps + 5 and time.monotonic() < deadline:
        time.sleep(0.01)  # holds the event loop: nothing is delivered meanwhile
    assert allm.engine.stats()["steps"] >= steps + 5
    outputs = [out async for out in stream]
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 30
    await allm.close()


@pytest.mark.parametrize("engine_process", [False, True])
async def test_a_requests_ttft_starts_when_the_front_end_takes_it(engine_process):
    """A request that arrives during a step waits for that step as `queued` time of its TTFT
    split, not outside it: the engine counts from the moment AsyncLLM took the request."""
    allm = slow_async_llm(block_size=4, num_gpu_blocks=64) if not engine_process else AsyncLLM(
        model="tiny-llama", block_size=4, num_gpu_blocks=64, engine_process=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    busy = allm.generate_stream(list(range(5, 30)), params)
    await anext(busy)  # the engine is stepping
    await asyncio.sleep(0.01)
    sent = time.monotonic()
    first = await anext(allm.generate_stream(list(range(40, 60)), SamplingParams(max_tokens=2, ignore_eos=True)))
    metrics = first.metrics
    assert sent <= metrics.arrival_time < sent + 0.02  # the step in progress takes 50 ms
    split = metrics.ttft_split
    assert sum(split.values()) == pytest.approx(metrics.ttft, abs=1e-9) and split["queued"] > 0
    async for _ in busy:
        pass
    await allm.close()


async def test_a_mailbox_joins_a_streams_outputs_once_too_many_wait_unread():
    box = Mailbox()
    for t in range(1, 200):  # cumulative outputs of stream "a", a text delta each
        box.put(RequestOutput("a", [1], list(range(t)), t == 199, text_delta=f"<{t}>"), "a")
        if t == 100:
            box.put(RequestOutput("b", [1], [7], True, text_delta="b"), "b")
    box.put(ValueError("failed"), "c")
    items = [await box.get() for _ in range(MAX_UNREAD_OUTPUTS + 2)]
    a = [out for key, out in items if key == "a"]
    assert [len(out.token_ids) for out in a[:-1]] == list(range(1, MAX_UNREAD_OUTPUTS))
    last = a[-1]  # stands for every output after the first 63: all the tokens, every text delta
    assert last.finished and last.token_ids == list(range(199))
    assert last.text_delta == "".join(f"<{t}>" for t in range(MAX_UNREAD_OUTPUTS, 200))
    assert [key for key, _ in items][-2:] == ["b", "c"] and isinstance(items[-1][1], ValueError)


async def test_a_stream_nobody_reads_holds_a_bounded_number_of_outputs():
    """A client that stops reading: its stream keeps the newest outputs, not one per token (each
    a copy of all the tokens so far)."""
    allm = AsyncLLM(model="tiny-llama", num_gpu_blocks=64)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    expected = (await allm.generate([5, 6, 7], params)).token_ids
    stream = allm.generate_stream([5, 6, 7], params)
    first = await stream.__anext__()
    await allm.drained()  # every token generated, none read
    rest = [out async for out in stream]
    assert len(rest) <= MAX_UNREAD_OUTPUTS and len(first.token_ids) + len(rest) < 300
    assert rest[-1].finished and rest[-1].token_ids == expected
    await allm.close()
