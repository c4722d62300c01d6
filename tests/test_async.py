"""AsyncLLM: streaming order, abort at every stage, cancellation, many concurrent requests."""

from __future__ import annotations

import asyncio

import pytest

from tests.reference import make_prompts
from tieredkv import AsyncLLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def assert_nothing_held(allm: AsyncLLM) -> None:
    stats = allm.stats()
    assert stats["gpu_blocks_used"] == 0
    assert stats.get("cpu_blocks_used", 0) == 0
    assert stats["requests_running"] == stats["requests_waiting"] == 0
    assert not allm.engine.scheduler.swapped and not allm.engine.seqs


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
    await allm._loop_task
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
    await allm._loop_task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert outputs == []  # no token was produced
    assert_nothing_held(allm)


async def test_abort_while_swapped():
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=30, max_num_batched_tokens=24,
                    cpu_cache_bytes="256KiB", preemption="swap")
    prompts = make_prompts(vocab_size=512)
    tasks = [asyncio.create_task(allm.generate(p, SamplingParams(max_tokens=40, temperature=0.0))) for p in prompts]
    while not allm.engine.scheduler.swapped:
        await asyncio.sleep(0.001)
    victim = allm.engine.scheduler.swapped[0]
    assert allm.engine.kv._swapped[victim.request_id]  # it holds CPU blocks
    index = [t for t in tasks if not t.done()]
    for task in index:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await allm._loop_task
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
    await allm._loop_task
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
