"""API hardening: bad sampling parameters, sampler failures that stay in their own request,
and misuse of `LLM` (threads, use after close, mixed APIs, odd prompt types)."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time

import numpy as np
import pytest
import torch

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


# ---------------------------------------------------------------- API misuse (item 6)


def test_two_threads_generating_on_one_llm_each_get_their_own_outputs(llm, expected):
    results: dict[int, list] = {}

    def work(i: int) -> None:
        results[i] = [tokens(llm.generate(PROMPTS[::-1] if i else PROMPTS, GREEDY, use_tqdm=False))
                      for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {0: [expected] * 3, 1: [expected[::-1]] * 3}
    assert_nothing_held(llm)


def test_use_after_close_says_closed():
    llm = LLM(model="tiny-llama", block_size=4, num_gpu_blocks=16)
    llm.close()
    with pytest.raises(RuntimeError, match="LLM is closed"):
        llm.generate([5, 6, 7], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="LLM is closed"):
        llm.add_request([5, 6, 7], GREEDY)
    llm.close()  # closing twice is harmless


def test_generate_refuses_to_run_beside_requests_added_by_hand(llm, expected):
    rid = llm.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match=f"add_request.*{rid}"):
        llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    finished = [out for _ in range(100) for out in llm.step() if out.finished]  # it still completes
    assert [(o.request_id, o.token_ids) for o in finished] == [(rid, expected[0])]
    assert_nothing_held(llm)
    assert tokens(llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)) == [expected[1]]


@pytest.mark.parametrize("as_array", [np.array, torch.tensor], ids=["numpy", "torch"])
def test_array_prompts(llm, expected, as_array):
    assert tokens(llm.generate(as_array(PROMPTS[2]), GREEDY, use_tqdm=False)) == [expected[2]]
    batch = [p[:5] for p in PROMPTS[1:]]
    assert tokens(llm.generate(as_array(batch), GREEDY, use_tqdm=False)) == tokens(
        llm.generate(batch, GREEDY, use_tqdm=False))
    outs = llm.generate([as_array(p) for p in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outs) == expected
    with pytest.raises(ValueError, match="prompts: .*3 dimensions"):
        llm.generate(as_array([[[5, 6]]]), GREEDY, use_tqdm=False)
    [bad] = llm.generate(as_array([1.5, 2.0]), GREEDY, use_tqdm=False)
    assert bad.finish_reason == "error" and "integer" in bad.error


def test_numpy_ints_are_token_ids_and_parameters(llm, expected):
    for kind in (np.int64, np.int32, np.uint16):
        prompt = [kind(t) for t in PROMPTS[3]]
        params = SamplingParams(max_tokens=np.int64(MAX_TOKENS), temperature=np.float32(0.0))
        assert tokens(llm.generate(prompt, params, use_tqdm=False)) == [expected[3]]
    params = SamplingParams(top_k=np.int64(2), seed=np.int64(3), stop_token_ids=[np.int64(7)],
                            ignore_eos=np.bool_(True))
    assert (params.top_k, params.seed, params.stop_token_ids, params.ignore_eos) == (2, 3, (7,), True)
    assert all(type(v) is int for v in (params.top_k, params.seed, *params.stop_token_ids))


@pytest.mark.parametrize(
    "prompt, message",
    [(None, "prompt: expected a string or token ids, got NoneType"),
     (b"hello", "prompt: got bytes; decode it to a str"),
     ({"prompt_token_ids": [5, 6]}, "prompt: got a dict; pass the string or the token ids"),
     ([5, None, 7], "prompt: token ids must be integers"),
     ([5, 6.0], "prompt: token ids must be integers"),
     ([True, 5], "prompt: token ids must be integers")],
    ids=["none", "bytes", "dict", "none-token", "float-token", "bool-token"],
)
def test_a_bad_prompt_fails_alone(llm, expected, prompt, message):
    outs = llm.generate([PROMPTS[0], prompt, PROMPTS[1]], GREEDY, use_tqdm=False)
    assert outs[1].finish_reason == "error" and re.search(message, outs[1].error)
    assert [outs[0].token_ids, outs[2].token_ids] == expected[:2]
    [alone] = llm.generate(prompt, GREEDY, use_tqdm=False)  # also when it is the only prompt
    assert alone.finish_reason == "error" and re.search(message, alone.error)
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompt, GREEDY)
    assert_nothing_held(llm)


def test_odd_calls_to_generate(llm):
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    [out] = llm.generate(5, GREEDY, use_tqdm=False)
    assert out.finish_reason == "error" and "prompt: expected a string or token ids, got int" in out.error
    with pytest.raises(ValueError, match="sampling_params: expected a SamplingParams, got dict"):
        llm.add_request([5, 6], {"temperature": 0})


@pytest.mark.parametrize(
    "kwargs, message",
    [({"seed": 2**64}, r"seed: expected an integer in \[0, 2\*\*64\)"),
     ({"seed": -1}, "seed: expected an integer"),
     ({"seed": 1.5}, "seed: expected an integer"),
     ({"ignore_eos": "no"}, "ignore_eos: expected True or False, got 'no'"),
     ({"ignore_eos": 1}, "ignore_eos: expected True or False"),
     ({"stop_token_ids": "5"}, "stop_token_ids: expected"),
     ({"stop_token_ids": [5.0]}, "stop_token_ids: expected"),
     ({"stop_token_ids": None}, "stop_token_ids: expected"),
     ({"top_k": True}, "top_k: expected an integer"),
     ({"max_tokens": 8.0}, "max_tokens: expected an integer")],
)
def test_bad_sampling_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_lenient_sampling_parameters():
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)
    assert SamplingParams(stop_token_ids=np.int64(5)).stop_token_ids == (5,)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_infinite_temperature_with_top_k_one_is_the_argmax(llm, expected):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=math.inf, top_k=1, seed=5)
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == expected


@pytest.mark.parametrize("arrival_time", [time.time() + 1e6, math.nan, -math.inf, "now", True])
def test_an_arrival_time_off_the_monotonic_clock_is_refused_by_name(llm, arrival_time):
    """A wall-clock reading (or no number at all) would give the request a negative or absurd
    TTFT split; the engine says what to pass and serves the next request."""
    engine = llm
    with pytest.raises(ValueError, match=r"arrival_time: expected a time.monotonic\(\) reading"):
        engine.add_request(PROMPTS[0], GREEDY, arrival_time=arrival_time)
    sent = time.monotonic() - 0.5
    request_id = engine.add_request(PROMPTS[0], GREEDY, arrival_time=sent)
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step()}
    assert outs[request_id].finished and outs[request_id].metrics.arrival_time == sent
    assert outs[request_id].metrics.ttft >= 0.5
    assert_nothing_held(engine)
