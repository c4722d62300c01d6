"""The prefill the GPU was given and has not finished (`LaunchedPrefill`)."""

from __future__ import annotations

import pytest
import torch

from tieredkv.launched_prefill import LaunchedPrefill


def test_on_the_cpu_a_step_is_done_when_it_returns():
    launched = LaunchedPrefill(torch.device("cpu"))
    launched.launched(100, 100, host_s=0.01)
    assert launched.tokens() == 0 and launched.launch_s(100) == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_launched_steps_count_until_the_gpu_has_run_them():
    launched = LaunchedPrefill(torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a kernel that spins for about a second
    launched.launched(100, 100, host_s=0.001)
    launched.launched(0, 8, host_s=0.5)  # a step of decodes only: nothing counted, nor learned
    launched.launched(50, 50, host_s=0.001)
    assert launched.tokens() == 150
    assert launched.launch_s(1000) == pytest.approx(0.01)  # 10 us a token
    torch.cuda.synchronize()
    assert launched.tokens() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_engine_learns_its_launch_time_from_its_prefill_steps():
    from tieredkv import LLM, SamplingParams

    with LLM(model="tiny-llama", device="cuda", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16) as llm:
        llm.generate([list(range(1, 60))], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert 0 < llm.stats()["launch_s_per_token"] < 0.01
