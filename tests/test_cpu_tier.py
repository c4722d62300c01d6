"""CPU tier: swap preemption, prefix demotion/promotion, the swap-vs-recompute policy, faults."""

from __future__ import annotations

import pytest
import torch

from tests.reference import make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.policy import CostModel, choose_preemption
from tieredkv.transfer.engine import TransferEngine, TransferError, TransferJob, consecutive_runs

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


def test_round_trip_of_scattered_blocks_is_bit_identical():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((3, 2, 20, 4, 2, 8), generator=gen).to(torch.bfloat16)
    original = kv.clone()
    cpu = torch.zeros((16, 3, 2, 4, 2, 8), dtype=torch.bfloat16)
    engine = TransferEngine(kv, cpu)
    gpu_ids = (17, 2, 9, 3, 11)
    cpu_ids = (5, 6, 7, 0, 12)
    out = engine.submit(TransferJob("d2h", gpu_ids, cpu_ids))
    kv.zero_()
    back = engine.submit(TransferJob("h2d", (1, 4, 19, 8, 0), cpu_ids))
    assert sorted(engine.poll()) == [out, back]
    for src, dst in zip(gpu_ids, (1, 4, 19, 8, 0), strict=True):
        assert torch.equal(kv[:, :, dst], original[:, :, src])
    assert engine.bytes_moved == {"d2h": 5 * cpu[0].numel() * 2, "h2d": 5 * cpu[0].numel() * 2}


def test_consecutive_runs():
    assert consecutive_runs((4, 5, 6, 9, 2, 3)) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert consecutive_runs(()) == []


COSTS = CostModel(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, prefill_s_per_token=1e-4, prefill_s_per_token_sq=1e-8)


@pytest.mark.parametrize(
    "mode, tokens, blocks, cpu_free, expected",
    [
        # 64 tokens: recompute 6.4 ms + tiny; swap of 4 blocks of 1 MiB: 8.4 ms -> recompute
        ("auto", 64, 4, 100, "recompute"),
        # 8k tokens: recompute 0.82 s + 0.67 s; swap of 512 MiB: 1.07 s -> swap
        ("auto", 8192, 512, 1000, "swap"),
        ("auto", 8192, 512, 511, "recompute"),  # CPU tier full
        ("swap", 64, 4, 100, "swap"),
        ("swap", 64, 4, 3, "recompute"),
        ("recompute", 8192, 512, 1000, "recompute"),
    ],
)
def test_policy_with_scripted_costs(mode, tokens, blocks, cpu_free, expected):
    assert choose_preemption(mode, tokens, blocks, 1 << 20, cpu_free, COSTS) == expected


def test_auto_without_cost_model_recomputes():
    assert choose_preemption("auto", 8192, 512, 1 << 20, 10_000, None) == "recompute"


def test_cpu_pool_exhaustion_falls_back_to_recompute(reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = pressured_llm("tiny-llama", "swap", cpu_bytes=8 * 8 * 1024)  # room for 8 blocks only
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    # under `swap`, a sequence that does not fit in the CPU tier is recomputed instead
    assert stats["preemptions"]["recompute"] > 0 and stats["preemptions"]["swap"] > 0


class FlakyTransfers:
    """Wraps a transfer engine's `_start`: every `period`-th job of `kind` fails to start."""

    def __init__(self, engine: TransferEngine, kind: str, period: int) -> None:
        self.start, self.kind, self.period, self.count, self.failed = engine._start, kind, period, 0, 0

    def __call__(self, job_id: int, job: TransferJob) -> None:
        if job.kind == self.kind:
            self.count += 1
            if self.count % self.period == 0:
                self.failed += 1
                raise RuntimeError("injected DMA failure")
        self.start(job_id, job)


@pytest.mark.parametrize("kind", ["d2h", "h2d"])
def test_transfer_failures_end_in_recompute(kind, reference_outputs, monkeypatch):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = pressured_llm("tiny-llama", "swap")
    transfers = llm.kv.offload.transfers
    flaky = FlakyTransfers(transfers, kind, period=2)
    monkeypatch.setattr(transfers, "_start", flaky)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert flaky.failed > 0 and stats["transfer_failures"] == flaky.failed
    assert stats["preemptions"]["recompute"] + stats["swap_fallbacks"] > 0
    assert stats["gpu_blocks_used"] == 0


def test_swap_needs_a_cpu_tier():
    with pytest.raises(ValueError, match="'swap' needs a CPU tier; set cpu_cache_bytes"):
        LLM(model="tiny-llama", preemption="swap")
    with pytest.raises(ValueError, match="hold no KV block"):
        LLM(model="tiny-llama", cpu_cache_bytes=100)


def test_a_copy_that_fails_to_start_raises_transfer_error(monkeypatch):
    engine = TransferEngine(torch.zeros((1, 2, 4, 2, 1, 2)), torch.zeros((2, 1, 2, 2, 1, 2)))
    monkeypatch.setattr(engine, "_start", FlakyTransfers(engine, "d2h", period=1))
    with pytest.raises(TransferError, match="d2h transfer of 1 blocks failed: injected DMA failure"):
        engine.submit(TransferJob("d2h", (0,), (1,)))
    assert engine.num_failures == 1 and engine.bytes_moved["d2h"] == 0
