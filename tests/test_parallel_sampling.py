"""Parallel sampling (`SamplingParams(n=..., best_of=...)`) and logprobs through the engine:
exact greedy copies, seeded samples that do not change with preemption or the tier a prefix
comes from, the prompt's blocks held once, logprobs equal to transformers'."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.reference import make_prompts
from tieredkv import LLM, AsyncLLM, SamplingParams
from tieredkv.model.presets import build_preset
from tieredkv.outputs import CompletionOutput

PROMPTS = make_prompts(vocab_size=512)[3:7]  # 40, 49, 33 and 70 tokens: partly filled last blocks
SWAP_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1.0}


def samples(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_n_gives_n_copies_of_the_greedy_tokens(reference_outputs):
    expected = reference_outputs("tiny-llama", PROMPTS, 20)
    with LLM(model="tiny-llama", block_size=16, num_gpu_blocks=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(n=3, max_tokens=20, temperature=0.0), use_tqdm=False)
        stats = llm.stats()
    assert samples(outs) == [[want] * 3 for want in expected]
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert out.token_ids == out.outputs[0].token_ids and out.finish_reason == out.outputs[0].finish_reason
    # each prompt's last block is partly filled: two of its three samples copy it before writing
    assert stats["cow_block_copies"] == 2 * len(PROMPTS)
    assert stats["gpu_blocks_used"] == 0


def test_one_sample_is_one_completion():
    with LLM(model="tiny-llama", num_gpu_blocks=32) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs == [CompletionOutput(0, out.token_ids, None, "length", None, None)]


SEEDED = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def seeded_baseline() -> list[list[list[int]]]:
    with LLM(model="tiny-llama", block_size=16, num_gpu_blocks=128) as llm:
        return samples(llm.generate(PROMPTS, SEEDED, use_tqdm=False))


def test_seeded_samples_are_reproducible_and_differ(seeded_baseline):
    with LLM(model="tiny-llama", block_size=16, num_gpu_blocks=128) as llm:
        again = samples(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
        first_only = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, seed=1234,
                                                          ignore_eos=True), use_tqdm=False)
    assert again == seeded_baseline
    for request in seeded_baseline:
        assert len({tuple(s) for s in request}) == 4  # sample i draws from seed + i
    assert [o.token_ids for o in first_only] == [request[0] for request in seeded_baseline]


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_seeded_samples_do_not_change_under_preemption(seeded_baseline, preemption):
    # 40 blocks of 4 tokens: the longest request (70 + 12 tokens) and its samples need 25 or more,
    # the four requests together about 90
    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32,
             cpu_cache_bytes="1MiB", preemption=preemption) as llm:
        outs = samples(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
        llm.kv.offload.drain()  # a demotion of the last step holds its CPU block until retired
        stats = llm.stats()
    assert outs == seeded_baseline
    assert stats["preemptions"][preemption] > 0 and stats["cow_block_copies"] > 0
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0


def tiered_llm(path) -> LLM:
    """GPU and CPU tiers too small for the prompts: they come back from the CPU tier or NVMe (a
    disk so fast that loading always wins). The LRU CPU tier writes every block it demotes.
    Arrival order (`fcfs`): under `ttft` the longest prompt, its prefix resident on the GPU,
    runs first the second time, so its blocks are never evicted and never reach the disk."""
    load_wins = {**SWAP_WINS, "prefill_s_per_token": 1e-3, "disk_read_bytes_per_s": 1e15}
    return LLM(model="tiny-llama", block_size=16, num_gpu_blocks=14, cpu_cache_bytes=12 * 8192,
               cpu_policy="lru", nvme_path=str(path), nvme_bytes="4MiB", preemption="recompute",
               scheduler={"cost_model": load_wins, "scheduling_policy": "fcfs"})


def test_seeded_samples_do_not_change_when_the_prompt_comes_from_the_cpu_or_nvme_tier(seeded_baseline, tmp_path):
    with tiered_llm(tmp_path) as llm:
        first = samples(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
        second = samples(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
        assert llm.stats()["cpu_hit_blocks"] > 0
    with tiered_llm(tmp_path) as llm:  # a restart: the prompts' blocks are on NVMe only
        third = samples(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
        assert llm.stats()["nvme_loaded_blocks"] > 0
    assert first == second == third == seeded_baseline


def test_eight_samples_hold_the_prompt_once():
    prompt = [(i * 37) % 509 + 3 for i in range(1000)]
    max_tokens, bs = 40, 16
    prompt_blocks, generated_blocks = -(-1000 // bs), -(-max_tokens // bs)
    bound = prompt_blocks + 8 * (generated_blocks + 1)
    with LLM(model="tiny-llama", block_size=bs, num_gpu_blocks=256) as llm:
        llm.add_request(prompt, SamplingParams(n=8, max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True))
        peak, outs = 0, []
        while llm.has_unfinished():
            outs += llm.step()
            used = llm.stats()["gpu_blocks_used"]
            assert used <= bound
            peak = max(peak, used)
        assert llm.stats()["preemptions"] == {"recompute": 0, "swap": 0}
    assert outs[-1].finished and [len(c.token_ids) for c in outs[-1].outputs] == [max_tokens] * 8
    # the prompt's 62 full blocks once, then each sample's copy of the 63rd and its own 3 blocks
    assert peak == 62 + 8 * 3 < 8 * prompt_blocks


def hf_logprobs(prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' next-token logprobs at every generated position: `[len(tokens), vocab]`."""
    model = build_preset("tiny-llama", seed=0)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_are_the_model_distributions():
    prompt = PROMPTS[0]
    params = SamplingParams(n=2, max_tokens=8, temperature=0.7, top_k=50, seed=5, logprobs=3)
    with LLM(model="tiny-llama", block_size=16, num_gpu_blocks=64) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    for sample in out.outputs:
        expected = hf_logprobs(prompt, sample.token_ids)
        assert len(sample.logprobs) == len(sample.token_ids)
        for pos, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
            top = expected[pos].topk(3)
            ranked = [t for t in entry if entry[t].rank <= 3]
            assert ranked == top.indices.tolist() and [entry[t].rank for t in ranked] == [1, 2, 3]
            assert [entry[t].logprob for t in ranked] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert entry[token].logprob == pytest.approx(expected[pos, token].item(), abs=1e-4)
            assert entry[token].rank == int((expected[pos] > expected[pos, token]).sum()) + 1
            assert len(entry) == 3 + (entry[token].rank > 3)
        assert sample.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(
            sample.token_ids, sample.logprobs, strict=True)))


def test_logprobs_with_a_tokenizer_carry_each_tokens_text(chat_model_dir):
    with LLM(model=chat_model_dir, num_gpu_blocks=32) as llm:
        out = llm.generate(["the cache"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2), use_tqdm=False)[0]
        decode = llm.tokenizer.decode
    for entry in out.outputs[0].logprobs:
        assert all(lp.decoded_token == decode([t]) for t, lp in entry.items())


def test_best_of_returns_the_n_most_likely_of_its_samples():
    common = dict(max_tokens=8, temperature=1.0, seed=77, ignore_eos=True)
    with LLM(model="tiny-llama", num_gpu_blocks=64) as llm:
        everyone = llm.generate([PROMPTS[1]], SamplingParams(n=4, logprobs=0, **common), use_tqdm=False)[0]
        best = llm.generate([PROMPTS[1]], SamplingParams(n=2, best_of=4, **common), use_tqdm=False)[0]
    ranked = sorted(everyone.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [c.index for c in ranked]
    assert best.outputs[0].logprobs is None  # nobody asked for them; the ranking needed the sums
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx([c.cumulative_logprob for c in ranked])


def test_more_samples_than_max_num_seqs_is_refused():
    with LLM(model="tiny-llama", num_gpu_blocks=32, max_num_seqs=4) as llm:
        with pytest.raises(ValueError, match=r"n: 5 sequences per request exceed max_num_seqs \(4\)"):
            llm.add_request([1, 2], SamplingParams(n=5))
        with pytest.raises(ValueError, match="best_of: 6 sequences"):
            llm.add_request([1, 2], SamplingParams(n=2, best_of=6))
    with pytest.raises(ValueError, match="best_of: expected an integer >= n"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="logprobs: expected an integer >= 0"):
        SamplingParams(logprobs=-1)


def test_aborting_a_forked_request_frees_all_its_samples():
    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=64, cpu_cache_bytes="256KiB",
             preemption="swap") as llm:
        rid = llm.add_request(PROMPTS[3], SamplingParams(n=4, max_tokens=30, temperature=1.0, seed=3))
        for _ in range(6):
            llm.step()
        out = llm.abort(rid)
        assert out.finished and out.finish_reason == "abort"
        assert [c.finish_reason for c in out.outputs] == ["abort"] * 4
        llm.kv.offload.drain()
        assert llm.stats()["gpu_blocks_used"] == 0 and not llm.has_unfinished() and not llm.seqs


def test_async_streams_carry_every_sample():
    async def run() -> list:
        allm = AsyncLLM(model="tiny-llama", num_gpu_blocks=64)
        outs = [o async for o in allm.generate_stream(PROMPTS[0], SamplingParams(n=3, max_tokens=5, seed=1))]
        await allm.close()
        return outs

    outs = asyncio.run(run())
    assert len(outs) == 5 and outs[-1].finished
    assert [len(c.token_ids) for c in outs[2].outputs] == [3, 3, 3]


def test_the_runners_block_copies_are_exact_beyond_one_staging_buffer():
    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=96) as llm:
        kv = llm.runner.kv_cache
        kv.copy_(torch.randn(kv.shape))
        before = kv.clone()
        copies = [(i % 30, 40 + i) for i in range(40)]  # 40 copies: three staging buffers' worth
        llm.runner.copy_blocks(copies)
    expected = before.clone()
    for src, dst in copies:
        expected[:, :, dst] = before[:, :, src]
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("policy", ["fcfs", "ttft"])
def test_a_request_not_forked_yet_holds_its_samples_slots(policy):
    # four n=4 requests under max_num_seqs=6: one at a time, since each becomes four sequences
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=256, max_num_seqs=6, scheduling_policy=policy) as llm:
        for prompt in PROMPTS:
            llm.add_request(prompt, params)
        most = 0
        while llm.has_unfinished():
            llm.step()
            most = max(most, len(llm.scheduler.running))
    assert most == 4
