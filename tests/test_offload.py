"""The CPU tier inside the engine: swap preemption, prefix demotion and promotion, transfer
faults, exact tokens throughout."""

from __future__ import annotations

import pytest

from tests.reference import make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.transfer.engine import FaultyTransfers

NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
# a cost model under which swapping always wins (copies are free, prefill is slow)
SWAP_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1.0}


def pressured_llm(preset: str, preemption: str, cpu_bytes: int | str = "256KiB", **kw) -> LLM:
    """A GPU tier just big enough for the longest request, so preemptions happen all the time."""
    return LLM(model=preset, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=24,
               cpu_cache_bytes=cpu_bytes, preemption=preemption, **kw)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("preemption", ["swap", "recompute", "auto"])
def test_exact_under_preemption(preset, preemption, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs(preset, prompts, NEW_TOKENS)
    extra = {"scheduler": {"cost_model": SWAP_WINS}} if preemption == "auto" else {}
    llm = pressured_llm(preset, preemption, **extra)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    if preemption == "recompute":
        assert stats["preemptions"] == {"recompute": stats["preemptions"]["recompute"], "swap": 0}
        assert stats["preemptions"]["recompute"] > 0
    else:
        assert stats["preemptions"]["swap"] > 0 and stats["preemptions"]["recompute"] == 0
        assert stats["bytes_d2h"] > 0 and stats["bytes_h2d"] > 0
    assert stats["cpu_demoted_blocks"] > 0
    assert stats["transfer_wait_s"] > 0  # the CPU twin's copies hold up the step
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0


def test_prefix_hits_from_cpu_tier_are_exact(reference_outputs):
    """A second round finds the prompts' prefixes in the CPU tier after the GPU evicted them."""
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = LLM(model="tiny-llama", block_size=4, num_gpu_blocks=30, cpu_cache_bytes="2MiB", preemption="recompute")
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits_before = llm.stats()["cpu_hit_blocks"]
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == expected
    assert llm.stats()["cpu_hit_blocks"] > hits_before


def test_a_promoted_prefix_computes_a_step_later_beside_its_copy(reference_outputs, monkeypatch):
    """The step that promotes a CPU prefix runs the other requests without ordering them after
    the copy; the returning request computes from the next step on, exactly."""
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = LLM(model="tiny-llama", block_size=4, num_gpu_blocks=64, cpu_cache_bytes="2MiB", preemption="recompute")
    assert llm.generate([prompts[6]], GREEDY, use_tqdm=False)[0].token_ids == expected[6]
    llm.kv.pool.release(llm.kv.pool.allocate(llm.kv.num_blocks))  # evict (demote) every GPU block
    transfers = llm.kv.offload.transfers
    forwards = []  # (request ids computed, jobs left for a later pass) of each forward pass
    order_compute, execute = transfers.order_compute, llm.runner.execute
    monkeypatch.setattr(transfers, "order_compute", lambda later=(): (
        forwards.append(([], set(later))), order_compute(later)))
    monkeypatch.setattr(llm.runner, "execute", lambda batch, tables: (
        forwards[-1][0].extend(s.seq.request_id for s in batch), execute(batch, tables))[1])

    other = llm.add_request(prompts[2], GREEDY)
    llm.step()
    returning = llm.add_request(prompts[6], GREEDY)
    done = {}
    while llm.has_unfinished():
        done.update((o.request_id, o.token_ids) for o in llm.step() if o.finished)
    assert done == {other: expected[2], returning: expected[6]}
    assert llm.stats()["cpu_hit_blocks"] == 70 // 4
    admitted = next(i for i, (_, later) in enumerate(forwards) if later)
    assert forwards[admitted][0] == [other]  # the returning request's copy runs beside this pass
    assert forwards[admitted + 1] == ([other, returning], set())  # ... and the next one waits for it


def test_cpu_pool_exhaustion_falls_back_to_recompute(reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = pressured_llm("tiny-llama", "swap", cpu_bytes=8 * 8 * 1024)  # room for 8 blocks only
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    # under `swap`, a sequence that does not fit in the CPU tier is recomputed instead
    assert stats["preemptions"]["recompute"] > 0 and stats["preemptions"]["swap"] > 0


@pytest.mark.parametrize("kind", ["d2h", "h2d"])
def test_transfer_failures_end_in_recompute(kind, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = pressured_llm("tiny-llama", "swap")
    llm.kv.offload.transfers = flaky = FaultyTransfers(llm.kv.offload.transfers)
    flaky.inject(kind, every=2)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert flaky.injected > 0 and stats["transfer_failures"] == flaky.injected
    assert stats["preemptions"]["recompute"] + stats["swap_fallbacks"] > 0
    assert stats["gpu_blocks_used"] == 0


def test_swap_needs_a_cpu_tier():
    with pytest.raises(ValueError, match="'swap' needs a CPU tier; set cpu_cache_bytes"):
        LLM(model="tiny-llama", preemption="swap")
    with pytest.raises(ValueError, match="hold no KV block"):
        LLM(model="tiny-llama", cpu_cache_bytes=100)


@pytest.mark.parametrize("preemption", ["swap", "auto"])
def test_a_sequence_preempted_while_its_prefix_lands_swaps_back_exactly(preemption, reference_outputs):
    """Admitted while its promoted prefix is still landing, a sequence holds blocks for a chunk
    it has not run; swapped out then, only the blocks of its computed tokens go to the CPU."""
    prompts = [[62, 467], [62, 467, 45, 279, 330, 273, 398, 22, 265, 433], [62, 294, 466, 299, 504, 408],
               [62, 467, 45, 380, 143], [62, 467, 45, 279, 33, 196, 465, 357, 47], [62, 319, 42, 488, 272, 146, 304]]
    expected = reference_outputs("tiny-llama", prompts, 6)
    llm = LLM(model="tiny-llama", block_size=1, num_gpu_blocks=17, max_num_batched_tokens=2, max_num_seqs=4,
              preemption=preemption, cpu_cache_bytes=64 * 512, scheduler={"cost_model": SWAP_WINS})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.stats()["preemptions"]["swap"] > 0
    llm.reset_prefix_cache()  # waits for the last transfers, which hold their CPU blocks until then
    stats = llm.stats()
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0


def test_the_tiers_are_booked_while_the_gpu_runs_the_step():
    """`KVCacheManager.retire` runs once a step, between the forward pass's launch and the
    sampling that waits for it (not before the next schedule, with the GPU idle); the first step,
    and the first after the idle loop tended the tiers, book them before scheduling too."""
    llm = pressured_llm("tiny-llama", "swap")
    events: list[str] = []

    def noted(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return call

    llm.kv.retire = noted("retire", llm.kv.retire)
    llm.runner.execute = noted("launch", llm.runner.execute)
    llm.decoder.process = noted("sample", llm.decoder.process)
    for i, prompt in enumerate(make_prompts(vocab_size=512)[:2]):
        llm.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0), f"r{i}")
    for _ in range(3):
        llm.step()
    assert events == ["retire", "launch", "retire", "sample"] + ["launch", "retire", "sample"] * 2
    events.clear()
    llm.tend_tiers()  # retires too (the idle loop's tend)
    llm.step()
    assert events == ["retire", "retire", "launch", "retire", "sample"]
