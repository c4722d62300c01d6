"""The transfer engine's two knobs against its two goals: swap bandwidth, and a decode step
running beside a swap.

For each (staging slots of 128 MiB, CTA cap of the gather/scatter kernels): swap-out and
swap-in of 2k, 8k and 32k tokens and both at once, in GPU time (see bench_transfer.py), as
ratios to the pinned peaks of the same run; and the decode step of the `llama-3-8b` preset
beside a 32k-token swap each way, eager at batch 32 and in a CUDA graph at batch 64, as the
slowdown against the step alone (median of 25 back-to-back pairs).

    python benchmarks/bench_swap_sweep.py
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import torch
from bench_transfer import (
    CPU_BLOCKS,
    POOL_BLOCKS,
    build,
    median_gpu_seconds,
    slowdown_beside,
    swap_job,
)
from common import pinned_peaks, require_cuda, time_cuda
from decode_step import DecodeStep

from tieredkv.transfer.cuda import CHUNK_BYTES, CudaTransferEngine

SETTINGS = ((8, None), (3, None), (2, None), (8, 64), (3, 64), (2, 64))  # (slots, CTA cap)


def swap_ratios(engine: CudaTransferEngine, peaks: dict[str, float], rng: random.Random) -> list[str]:
    cells = []
    for tokens in (2048, 8192, 32768):
        for kind in ("d2h", "h2d"):
            job = swap_job(kind, tokens, rng, range(POOL_BLOCKS), range(CPU_BLOCKS))
            gbs = len(job.gpu_block_ids) * engine.block_bytes / median_gpu_seconds(engine, [job]) / 1e9
            cells.append(f"{kind} {tokens // 1024}k {gbs / peaks[f'{kind}_peak_gbs']:.1%}")
    half = 16384
    out_job = swap_job("d2h", half, rng, range(POOL_BLOCKS // 2), range(CPU_BLOCKS // 2))
    in_job = swap_job("h2d", half, rng, range(POOL_BLOCKS // 2, POOL_BLOCKS), range(CPU_BLOCKS // 2, CPU_BLOCKS))

    gbs = 2 * len(out_job.gpu_block_ids) * engine.block_bytes / median_gpu_seconds(engine, [out_job, in_job]) / 1e9
    cells.append(f"two-way {gbs / peaks['two_way_peak_gbs']:.1%}")
    return cells


def slowdowns(engine: CudaTransferEngine, steps: dict[str, Callable[[], object]], rng: random.Random) -> list[str]:
    cells = []
    for kind in ("d2h", "h2d"):
        job = swap_job(kind, 32768, rng, range(POOL_BLOCKS), range(CPU_BLOCKS))
        for name, step in steps.items():
            cells.append(f"{kind}/{name} {statistics.median(slowdown_beside(engine, job, step)) - 1:+.1%}")
    return cells


def main() -> None:
    require_cuda()
    peaks = pinned_peaks()
    print(", ".join(f"{k} {v:.2f}" for k, v in peaks.items()))
    first, tier = build()
    rng = random.Random(0)
    eager_step = DecodeStep(batch=32, context=2048)
    runner = eager_step.runner
    eager_alone = time_cuda(eager_step, reps=10)
    graph_step = DecodeStep(batch=64, context=2048, runner=runner)
    runner.capture_graphs(64, max_mixed_tokens=0)
    graphs = runner.graphs

    def eager() -> torch.Tensor:
        runner.graphs = None
        try:
            return eager_step()
        finally:
            runner.graphs = graphs

    graph_alone = time_cuda(graph_step, reps=10)
    print(f"decode step alone: eager batch 32 {eager_alone * 1e3:.2f} ms, graph batch 64 {graph_alone * 1e3:.2f} ms")
    steps = {"eager": eager, "graph": graph_step}
    for slots, programs in SETTINGS:
        engine = CudaTransferEngine(first.kv_cache, tier.data, staging_bytes=slots * CHUNK_BYTES,
                                    copy_programs=programs)
        cells = swap_ratios(engine, peaks, rng) + ["| beside a 32k swap:"] + slowdowns(engine, steps, rng)
        print(f"slots {slots}, CTA cap {programs}: " + " ".join(cells), flush=True)
    tier.close()


if __name__ == "__main__":
    main()
