"""Fork and copy-on-write on CUDA: the block-copy kernels' copy-on-write, parallel samples and
beam search with their steps replayed as CUDA graphs (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.reference import hf_beams, make_prompts
from tieredkv import LLM, BeamSearchParams, SamplingParams
from tieredkv.model.presets import build_preset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = make_prompts(vocab_size=512)[3:6]  # 40, 49 and 33 tokens: partly filled last blocks


def replayed_steps(llm: LLM) -> list[tuple[int, int]]:
    """The (tokens, sequences) bucket of every step `llm` runs as a graph from now on."""
    replayed: list[tuple[int, int]] = []
    run = llm.runner.graphs.run
    llm.runner.graphs.run = lambda step, key: (replayed.append(key), run(step, key))[1]
    return replayed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_copy_blocks_is_bit_exact(dtype):
    with LLM(model="tiny-llama", device="cuda", dtype=dtype, block_size=16, num_gpu_blocks=96) as llm:
        kv = llm.runner.kv_cache
        kv.copy_(torch.randn(kv.shape, device="cuda").to(kv.dtype))
        before = kv.clone()
        # 40 copies (more than one staging buffer), sources that are also read by other copies
        copies = [(i % 30, 40 + i) for i in range(40)]
        llm.runner.copy_blocks(copies)
        torch.cuda.synchronize()
    expected = before.clone()
    for src, dst in copies:
        expected[:, :, dst] = before[:, :, src]
    assert torch.equal(kv, expected)


def test_gpu_parallel_samples_copy_on_write_under_cuda_graphs(reference_outputs):
    expected = reference_outputs("tiny-llama", PROMPTS, 24)
    with LLM(model="tiny-llama", device="cuda", block_size=16, num_gpu_blocks=64, max_num_seqs=12) as llm:
        replayed = replayed_steps(llm)
        outs = llm.generate(PROMPTS, SamplingParams(n=4, max_tokens=24, temperature=0.0), use_tqdm=False)
        stats = llm.stats()
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[want] * 4 for want in expected]
    assert stats["cow_block_copies"] == 3 * len(PROMPTS)
    assert any(t == b == 12 for t, b in replayed)  # the 12 samples decode as one graph


@pytest.mark.parametrize("width", [2, 4])
def test_gpu_beam_search_under_cuda_graphs_matches_transformers(width):
    model = build_preset("tiny-llama", seed=0)
    with torch.inference_mode():
        expected = [[tokens for tokens, _ in hf_beams(model, p, width, 8)] for p in PROMPTS]  # CPU, float32
    with LLM(model="tiny-llama", device="cuda", block_size=4, num_gpu_blocks=20, max_num_batched_tokens=32,
             cpu_cache_bytes="256KiB", preemption="swap", max_num_seqs=16) as llm:
        replayed = replayed_steps(llm)
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=8), use_tqdm=False)
        stats = llm.stats()
    assert [[s.token_ids for s in o.sequences] for o in outs] == expected
    assert stats["preemptions"]["swap"] > 0 and stats["cow_block_copies"] > 0
    assert any(t == b for t, b in replayed)
