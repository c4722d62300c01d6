"""The prefill the GPU was given and has not finished (`LaunchedPrefill`)."""

from __future__ import annotations

import pytest
import torch

from tieredkv.launched_prefill import LaunchedPrefill, LaunchTime


def test_on_the_cpu_a_step_is_done_when_it_returns():
    launched = LaunchedPrefill(torch.device("cpu"))
    launched.launched(100, 100, host_s=0.01)
    assert launched.tokens() == 0 and launched.launch_s(100) == 0.0


def test_the_launch_time_is_a_time_every_step_takes_plus_a_time_a_token():
    launch = LaunchTime()
    assert launch.fit() == (0.0, 0.0) and launch.seconds(8192) == 0.0
    # questions of 80 tokens beside chunks of 8,192: 3 ms a step, 0.5 us a token
    for tokens in [80, 8192, 8192, 80, 80, 8192, 4096, 80] * 10:
        launch.learn(tokens, 0.003 + 0.5e-6 * tokens)
    fixed, per_token = launch.fit()
    assert fixed == pytest.approx(0.003) and per_token == pytest.approx(0.5e-6)
    # not one step's time a token: after a question, 38 us, which would put a chunk at 311 ms
    assert launch.seconds(8192) == pytest.approx(0.003 + 0.5e-6 * 8192)


def test_steps_of_one_size_teach_their_launch_time_and_no_time_a_token():
    launch = LaunchTime()
    for _ in range(5):
        launch.learn(8192, 0.004)
    assert launch.fit() == pytest.approx((0.004, 0.0))
    # and steps whose launch grows faster than their size go through the origin, never below it
    launch = LaunchTime()
    for tokens in [100, 1000] * 10:
        launch.learn(tokens, tokens * tokens * 1e-9)
    fixed, per_token = launch.fit()
    assert fixed == 0.0 and per_token > 0 and launch.seconds(1) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_launched_steps_count_until_the_gpu_has_run_them():
    launched = LaunchedPrefill(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a kernel that spins for about a second
    launched.launched(100, 100, host_s=0.001)
    launched.launched(0, 8, host_s=0.5)  # a step of decodes only: nothing counted, nor learned
    launched.launched(50, 50, host_s=0.0005)
    assert launched.tokens() == 150
    assert launched.launch_s(1000) == pytest.approx(0.01)  # 10 us a token, nothing a step
    torch.cuda.synchronize()
    assert launched.tokens() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engine_learns_its_launch_time_from_its_prefill_steps():
    from tieredkv import LLM, SamplingParams

    with LLM(model="tiny-llama", device="cuda", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16) as llm:
        llm.generate([list(range(1, 60))], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        stats = llm.stats()
        assert 0 < stats["launch_s_fixed"] + 100 * stats["launch_s_per_token"] < 1.0


def test_the_loop_time_learned_ends_where_the_launch_begins(monkeypatch):
    """The launch call waits for the GPU once its queue of kernels is full: that wait is the
    GPU's queue, not the loop's time, and is not learned as the loop's."""
    import time

    from tieredkv import LLMEngine, SamplingParams
    from tieredkv.config import EngineConfig

    engine = LLMEngine(EngineConfig.from_kwargs(model="tiny-llama", block_size=4, num_gpu_blocks=64,
                                                max_num_batched_tokens=16))
    learned: list[float] = []
    monkeypatch.setattr(engine.launched, "launched", lambda prefill, tokens, host_s: learned.append(host_s))
    execute = engine.runner.execute

    def launch_behind_a_full_queue(*args, **kwargs):
        time.sleep(0.5)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", launch_behind_a_full_queue)
    engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert len(learned) >= 3 and max(learned) < 0.25
