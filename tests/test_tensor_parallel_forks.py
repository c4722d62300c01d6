"""Forks at two ranks (gloo): `n`, `best_of`, `logprobs` and beam search give one rank's
tokens and log-probabilities (same weights, same seeds), in one batch with plain requests; the
forks' copy-on-write block copies run on both ranks."""

from __future__ import annotations

import pytest
import torch

from tests.reference import make_prompts
from tieredkv import LLM, BeamSearchParams, SamplingParams
from tieredkv.outputs import CompletionOutput

PROMPTS = make_prompts(vocab_size=512)[1:6]  # 5, 16, 40, 49 and 33 tokens: partly filled last blocks too
PARAMS = [
    SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=11),
    SamplingParams(max_tokens=8, n=2, best_of=4, temperature=1.0, seed=5),
    SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=3),
    SamplingParams(max_tokens=8, n=2, temperature=0.7, top_k=20, seed=2, logprobs=0, min_tokens=4),
    SamplingParams(max_tokens=8, temperature=0.0),
]
TOLERANCE = 1e-4  # the ranks' all-reduce sums in another order: logits agree to float32 rounding


@pytest.fixture(scope="module")
def engines():
    """One rank and two, the same random weights; block size 4, so the forks share a partly
    filled last block and copy it on their first write."""
    kw = dict(model="tiny-llama", device="cpu", dtype="float32", block_size=4, num_gpu_blocks=96)
    with LLM(**kw) as one, LLM(**kw, tensor_parallel_size=2) as two:
        yield one, two


def assert_same_completion(got: CompletionOutput, want: CompletionOutput) -> None:
    assert (got.index, got.token_ids, got.finish_reason) == (want.index, want.token_ids, want.finish_reason)
    if want.cumulative_logprob is None:
        assert got.cumulative_logprob is None
    else:
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=TOLERANCE)
    assert (got.logprobs is None) == (want.logprobs is None)
    for got_step, want_step in zip(got.logprobs or [], want.logprobs or [], strict=True):
        assert list(got_step) == list(want_step)  # the same tokens, in the same order
        for token, entry in want_step.items():
            assert (got_step[token].rank, got_step[token].decoded_token) == (entry.rank, entry.decoded_token)
            assert got_step[token].logprob == pytest.approx(entry.logprob, abs=TOLERANCE)


def assert_same_outputs(got, want, got_beams, want_beams) -> None:
    """Every request's completions and every beam search's sequences equal one rank's."""
    for g, w in zip(got, want, strict=True):
        assert g.error is None and len(g.outputs) == len(w.outputs)
        for got_out, want_out in zip(g.outputs, w.outputs, strict=True):
            assert_same_completion(got_out, want_out)
    assert [[s.token_ids for s in o.sequences] for o in got_beams] == [
        [s.token_ids for s in o.sequences] for o in want_beams
    ]


def test_samples_best_of_and_logprobs_at_two_ranks_equal_one_rank(engines):
    one, two = engines
    want = one.generate(PROMPTS, PARAMS, use_tqdm=False)
    copies_before = two.stats()["cow_block_copies"]
    got = two.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.error for o in got] == [None] * len(PROMPTS)
    assert [len(o.outputs) for o in got] == [3, 2, 1, 2, 1]
    for g, w in zip(got, want, strict=True):
        for got_out, want_out in zip(g.outputs, w.outputs, strict=True):
            assert_same_completion(got_out, want_out)
    samples = got[0].outputs
    assert len({tuple(s.token_ids) for s in samples}) > 1  # each sample drew with a generator of its own
    assert len(got[2].outputs[0].logprobs) == 8 and all(len(step) >= 3 for step in got[2].outputs[0].logprobs)
    assert two.stats()["cow_block_copies"] > copies_before  # forks wrote into shared blocks on both ranks
    assert two.stats()["gpu_blocks_used"] == 0


def test_beam_search_at_two_ranks_equals_one_rank(engines):
    one, two = engines
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    want = one.beam_search(PROMPTS[:3], params, use_tqdm=False)
    got = two.beam_search(PROMPTS[:3], params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.error is None and len(g.sequences) == len(w.sequences) == 3
        assert [s.token_ids for s in g.sequences] == [s.token_ids for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in w.sequences],
                                                                     abs=TOLERANCE)
    assert two.stats()["gpu_blocks_used"] == 0


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_forks_preempted_at_two_ranks_equal_one_rank(preemption):
    """A GPU tier too small for every sample at once: samples and beams are preempted (their
    shared blocks swapped once, or recomputed) and come back with one rank's tokens."""
    kw = dict(model="tiny-llama", device="cpu", dtype="float32", block_size=4, num_gpu_blocks=24,
              cpu_cache_bytes="256KiB", preemption=preemption)
    params = [SamplingParams(max_tokens=16, n=4, temperature=1.0, seed=7, logprobs=1), PARAMS[1]]
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    with LLM(**kw) as one:
        want = one.generate(PROMPTS[1:3], params, use_tqdm=False)
        want_beams = one.beam_search(PROMPTS[2:4], beams, use_tqdm=False)
    with LLM(**kw, tensor_parallel_size=2) as two:
        got = two.generate(PROMPTS[1:3], params, use_tqdm=False)
        got_beams = two.beam_search(PROMPTS[2:4], beams, use_tqdm=False)
        stats = two.stats()
    assert stats["preemptions"][preemption] > 0
    assert_same_outputs(got, want, got_beams, want_beams)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_forks_on_two_gpus_equal_one_gpu():
    """NCCL, CUDA graphs: samples, best_of, logprobs and beams at two ranks give one GPU's."""
    kw = dict(model="tiny-llama", device="cuda", dtype="float32", block_size=16, num_gpu_blocks=96)
    beams = BeamSearchParams(beam_width=3, max_tokens=6)
    with LLM(**kw) as one:
        want = one.generate(PROMPTS, PARAMS, use_tqdm=False)
        want_beams = one.beam_search(PROMPTS[:3], beams, use_tqdm=False)
    with LLM(**kw, tensor_parallel_size=2) as two:
        got = two.generate(PROMPTS, PARAMS, use_tqdm=False)
        got_beams = two.beam_search(PROMPTS[:3], beams, use_tqdm=False)
        assert two.stats()["cow_block_copies"] > 0
    assert_same_outputs(got, want, got_beams, want_beams)
