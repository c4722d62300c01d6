"""API hardening: bad sampling parameters, sampler failures that stay in their own request,
and misuse of `LLM` (threads, use after close, mixed APIs, odd prompt types)."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.reference import make_prompts
from tieredkv import LLM, AsyncLLM, SamplingParams
from tieredkv.sampling import SAMPLING_EPS

PROMPTS = make_prompts(vocab_size=512)[:4]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)


@pytest.fixture(scope="module")
def expected(reference_outputs):
    return reference_outputs("tiny-llama", PROMPTS, MAX_TOKENS)


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def assert_nothing_held(engine) -> None:
    stats = engine.stats()
    assert stats["gpu_blocks_used"] == 0 and stats["requests_running"] == stats["requests_waiting"] == 0
    assert not engine.seqs


def poisoned(**kwargs) -> SamplingParams:
    """Parameters that slipped past validation with a NaN temperature: the sampler cannot use them."""
    params = SamplingParams(**kwargs)
    object.__setattr__(params, "temperature", math.nan)
    return params


# ---------------------------------------------------------------- temperatures (item 5)


@pytest.mark.parametrize("bad", [math.nan, -math.inf, "0.5", True, None])
def test_temperature_must_be_a_number_that_is_not_nan(bad):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=bad)


def test_tiny_temperature_is_greedy():
    assert SAMPLING_EPS == 1e-5
    for tiny in (1e-45, 5e-324, 0.0, 9.9e-6):
        assert SamplingParams(temperature=tiny).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_subnormal_temperature_gives_the_greedy_tokens(llm, expected):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-45), use_tqdm=False)
    assert tokens(outs) == expected


def test_a_sampler_error_fails_only_its_own_request(llm, expected):
    params = [GREEDY, poisoned(max_tokens=MAX_TOKENS), GREEDY, GREEDY]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.finish_reason == "error" and "sampl" in bad.error and bad.token_ids == []
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [e for i, e in enumerate(expected) if i != 1]
    assert_nothing_held(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected  # the engine still works


async def test_a_sampler_error_leaves_async_neighbours_running(expected):
    allm = AsyncLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    params = [GREEDY, poisoned(max_tokens=MAX_TOKENS, seed=1), GREEDY, GREEDY]
    requests = (allm.generate(p, sp) for p, sp in zip(PROMPTS, params, strict=True))
    outs = await asyncio.wait_for(asyncio.gather(*requests), 60)
    assert outs[1].finish_reason == "error" and outs[1].error
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [e for i, e in enumerate(expected) if i != 1]
    assert_nothing_held(allm.engine)
    await allm.close()


class FailingLLM(LLM):
    """An LLM whose third step raises, as a broken kernel or a bad device would."""

    calls = 0

    def step(self):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("device fault")
        return super().step()


def test_a_failed_step_releases_the_batch_and_generate_keeps_working(expected):
    llm = FailingLLM(model="tiny-llama", block_size=4, num_gpu_blocks=64)
    with pytest.raises(RuntimeError, match="device fault"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_nothing_held(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
