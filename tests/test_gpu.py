"""The engine on CUDA: Triton kernels, CUDA transfer engine, pinned CPU tier (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.reference import make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.engine import TransferJob

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
SWAP_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1.0}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("preemption", ["swap", "recompute", "auto"])
def test_gpu_greedy_matches_transformers(preset, preemption, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs(preset, prompts, NEW_TOKENS)  # transformers, float32, CPU
    extra = {"scheduler": {"cost_model": SWAP_WINS}} if preemption == "auto" else {}
    llm = LLM(model=preset, device="cuda", block_size=4, num_gpu_blocks=30, max_num_batched_tokens=24,
              cpu_cache_bytes="256KiB", preemption=preemption, **extra)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    kind = "recompute" if preemption == "recompute" else "swap"
    assert stats["preemptions"][kind] > 0
    assert stats["cpu_demoted_blocks"] > 0
    llm.close()


def test_gpu_large_cache_and_cpu_prefix_hits(reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with LLM(model="tiny-llama", device="cuda", block_size=16, num_gpu_blocks=12, cpu_cache_bytes="4MiB") as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["cpu_hit_blocks"] > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == expected


def test_gpu_the_block_copies_compile_when_the_transfer_engine_is_made():
    """A fresh engine's first CPU hit or lower-tier load waited ~0.4 s for Triton to compile
    the scatter: both copies compile when the transfer engine is made, and its first jobs
    compile nothing. The block shape is this test's own, so no other test compiled it."""
    from tieredkv.kernels.block_copy import _copy_blocks_kernel

    from tieredkv.transfer.cuda import CudaTransferEngine

    def compiled() -> int:
        return sum(len(caches[0]) for caches in _copy_blocks_kernel.device_caches.values())

    kv = torch.randn((3, 2, 37, 5, 1, 24), device="cuda")
    tier = CPUTier(9, (3, 2, 5, 1, 24), torch.float32, pin=True)
    before = compiled()
    engine = CudaTransferEngine(kv, tier.data)
    assert compiled() == before + 2  # the gather and the scatter
    engine.wait([engine.submit(TransferJob("d2h", (4, 30), (1, 2)))])
    engine.wait([engine.submit(TransferJob("h2d", (36, 0), (1, 2)))])
    assert compiled() == before + 2
    assert torch.equal(kv[:, :, [36, 0]], kv[:, :, [4, 30]])
    tier.close()


def test_gpu_round_trip_is_bit_identical(monkeypatch):
    from tieredkv.transfer import cuda as transfer_cuda
    from tieredkv.transfer.cuda import CudaTransferEngine
    from tieredkv.transfer.engine import consecutive_runs

    shape = (4, 2, 64, 16, 2, 64)
    kv = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    original = kv.clone()
    tier = CPUTier(48, (4, 2, 16, 2, 64), torch.bfloat16, pin=True)
    assert tier.pinned
    # chunks of 4 blocks through a ring of 2 staging slots: 6 chunks a job, slots reused
    block_bytes = tier.data[0].numel() * 2
    engine = CudaTransferEngine(kv, tier.data, staging_bytes=8 * block_bytes, chunk_bytes=4 * block_bytes)
    gpu_ids = tuple(range(63, 0, -3))  # 21 scattered blocks
    cpu_ids = tuple(list(range(10, 20)) + list(range(40, 29, -1)))  # two runs, one listed backwards
    dmas = []

    def spy(ids):
        dmas.append(runs := consecutive_runs(ids))
        return runs

    monkeypatch.setattr(transfer_cuda, "consecutive_runs", spy)
    out = engine.submit(TransferJob("d2h", gpu_ids, cpu_ids))
    assert sum(map(len, dmas)) == 6 + 1  # in CPU order: one DMA a chunk, two for the chunk that spans both runs
    engine.order_compute()
    kv.zero_()  # on the compute stream: must wait for the gather to have read the blocks
    back = engine.submit(TransferJob("h2d", gpu_ids, cpu_ids))
    engine.order_compute(later={back})  # this pass does not read the blocks: it need not wait
    assert list(engine._compute_waits) == [back]
    engine.wait([out, back])
    assert sorted(engine.poll()) == [out, back]
    engine.order_compute()
    assert not engine._compute_waits
    torch.cuda.synchronize()
    engine.poll()  # books the finished compute waits: stats() read from another thread makes no CUDA call
    assert not engine._stalls and engine.compute_wait_s >= 0
    for g in gpu_ids:
        assert torch.equal(kv[:, :, g], original[:, :, g])
    # a swap-out and a swap-in of other blocks at the same time do not disturb each other
    kv.copy_(original)
    engine.order_compute()
    out = engine.submit(TransferJob("d2h", gpu_ids[:10], cpu_ids[:10]))
    back = engine.submit(TransferJob("h2d", (1, 2, 4, 5), (30, 31, 32, 33)))
    engine.wait([out, back])
    engine.order_compute()
    held = [gpu_ids[cpu_ids.index(c)] for c in (30, 31, 32, 33)]
    for src, dst in zip(held, (1, 2, 4, 5), strict=True):
        assert torch.equal(kv[:, :, dst], original[:, :, src])
    moved = original[:, :, list(gpu_ids[:10])].permute(2, 0, 1, 3, 4, 5).cpu()
    assert torch.equal(tier.data[torch.tensor(cpu_ids[:10])], moved)
    tier.close()


def test_gpu_submit_leaves_the_callers_stream_current():
    """A job makes its side streams current in turn: the caller's stream is current again
    after it, also after a job that failed half-way, and the job read what the caller's stream
    wrote before it."""
    from tieredkv.transfer.cuda import CudaTransferEngine
    from tieredkv.transfer.engine import TransferError

    kv = torch.randn((2, 2, 16, 4, 1, 8), device="cuda")
    tier = CPUTier(8, (2, 2, 4, 1, 8), torch.float32, pin=True)
    engine = CudaTransferEngine(kv, tier.data)
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(50_000_000)  # ~25 ms: the gather below must wait for the fill after it
        kv[:, :, 3].fill_(7.0)
        out = engine.submit(TransferJob("d2h", (3,), (5,)))
        assert torch.cuda.current_stream() == caller
        with pytest.raises(TransferError):
            engine.submit(TransferJob("h2d", (4,), (99,)))  # the CPU tier has no block 99
        assert torch.cuda.current_stream() == caller
        engine.wait([out])
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert bool((tier.data[5] == 7.0).all())
    tier.close()


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_with_and_without_cuda_graphs(enforce_eager, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-qwen3", prompts, NEW_TOKENS)
    with LLM(model="tiny-qwen3", device="cuda", block_size=16, num_gpu_blocks=64, max_num_seqs=6,
             enforce_eager=enforce_eager) as llm:
        replayed = []  # (tokens, sequences) bucket of every step run as a graph
        if not enforce_eager:
            run = llm.runner.graphs.run
            llm.runner.graphs.run = lambda step, key: (replayed.append(key), run(step, key))[1]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert (llm.runner.graphs is None) == enforce_eager
    assert [o.token_ids for o in outs] == expected
    if not enforce_eager:  # decode steps and mixed steps (prefill chunks beside decodes) both replayed
        assert any(t == b for t, b in replayed) and any(t > b for t, b in replayed)


def test_gpu_closed_engine_graphs_never_break_a_later_capture(monkeypatch, reference_outputs):
    """A closed engine that only a reference cycle keeps alive is collected whenever the
    collector runs, here in the middle of the next engine's graph capture (as in a `--compare`
    run's next variant): its graphs were released at close, so the capture and the tokens are
    unharmed."""
    import gc

    from tieredkv.model.cuda_graphs import StepGraphs

    first = LLM(model="tiny-llama", device="cuda", block_size=16, num_gpu_blocks=64, max_num_seqs=4)
    first.close()
    assert first.runner.graphs is None
    first.cycle = first  # collected only by the collector
    del first
    forward = StepGraphs._forward

    def collecting_forward(self, t, b):
        if torch.cuda.is_current_stream_capturing():
            gc.collect()
        return forward(self, t, b)

    monkeypatch.setattr(StepGraphs, "_forward", collecting_forward)
    prompts = make_prompts(vocab_size=512)
    with LLM(model="tiny-llama", device="cuda", block_size=16, num_gpu_blocks=64, max_num_seqs=4) as second:
        assert second.runner.graphs is not None
        outs = second.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference_outputs("tiny-llama", prompts, NEW_TOKENS)


@pytest.mark.parametrize(("block_size", "dtype"), [(16, None), (64, "bfloat16")])
def test_gpu_mixed_step_graphs_match_eager(block_size, dtype):
    """Mixed steps of every shape (chunks of a few to hundreds of tokens beside decodes, each
    padded into its bucket) give the logits of the same step run eagerly; with 64-token bf16
    pages the prefill rows take the paged TMA kernel (Hopper), its descriptors captured too."""
    from tieredkv.model.runner import StepInputs
    from tieredkv.sequence import ScheduledSeq, Sequence

    extra = {"dtype": dtype} if dtype else {}
    with LLM(model="tiny-llama", device="cuda", block_size=block_size, num_gpu_blocks=8192 // block_size,
             max_num_seqs=16, **extra) as llm:
        runner, graphs = llm.runner, llm.runner.graphs
        gen = torch.Generator().manual_seed(0)
        runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=gen).to(runner.kv_cache.dtype))
        for chunks in ([1, 1, 5], [1] * 7 + [120], [200, 1, 3], [1] * 14 + [900], [64] * 8):
            scheduled, tables, first = [], [], 0
            for i, chunk in enumerate(chunks):
                context = 40 + 13 * i + chunk
                seq = Sequence(str(i), torch.randint(3, 500, (context,), generator=gen).tolist(), GREEDY)
                seq.num_computed_tokens = context - chunk
                blocks = -(-context // block_size)
                scheduled.append(ScheduledSeq(seq, chunk))
                tables.append(list(range(first, first + blocks)))
                first += blocks
            key = graphs.bucket(StepInputs.build(scheduled, tables, block_size))
            assert key is not None and key[0] > key[1], chunks
            replayed = runner.execute(scheduled, tables)
            runner.graphs = None
            eager = runner.execute(scheduled, tables)
            runner.graphs = graphs
            # bf16: the padded graph's matmuls round differently; allow two bf16 steps of the
            # largest logit (a wrong page would move logits by far more)
            atol = 1e-4 if dtype is None else eager.abs().max().item() * 2**-6
            torch.testing.assert_close(replayed, eager, rtol=1e-4 if dtype is None else 0, atol=atol)
