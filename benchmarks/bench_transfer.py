"""Swap bandwidth of the transfer engine against the pinned-copy peaks of the same run.

- swap-out and swap-in of one sequence of 2k, 8k and 32k tokens of Llama-3-8B KV scattered
  over the GPU pool (target: >= 95% of the pinned peak each way);
- a swap-out and a swap-in at the same time (target: >= 90% of the two-way peak);
- with --decode: a decode step of the `llama-3-8b` preset (batch 32, context 2048) with and
  without a 32k-token swap running beside it (target: at most 5% slower).

    python benchmarks/bench_transfer.py [--decode] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable

import torch
from common import (
    LLAMA8B_BLOCK_SHAPE,
    pinned_peaks,
    report,
    require_cuda,
    time_cuda,
    write_json,
)

from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer import TransferJob
from tieredkv.transfer_cuda import CudaTransferEngine

BLOCK_SIZE = 16
POOL_BLOCKS = 4608  # 9 GiB of GPU KV, 2 MiB a block
CPU_BLOCKS = 4608


def build(pool_blocks: int = POOL_BLOCKS, cpu_blocks: int = CPU_BLOCKS) -> tuple[CudaTransferEngine, CPUTier]:
    layers, two, bs, heads, dim = LLAMA8B_BLOCK_SHAPE
    kv = torch.randn((layers, two, pool_blocks, bs, heads, dim), device="cuda", dtype=torch.bfloat16)
    tier = CPUTier(cpu_blocks, LLAMA8B_BLOCK_SHAPE, torch.bfloat16, pin=True)
    assert tier.pinned, "the CPU tier could not be pinned"
    return CudaTransferEngine(kv, tier.data), tier


def swap_job(kind: str, tokens: int, rng: random.Random, gpu_range: range, cpu_range: range) -> TransferJob:
    """A job for one sequence: GPU blocks scattered at random, CPU blocks as the pool hands them out."""
    n = tokens // BLOCK_SIZE
    gpu = tuple(rng.sample(gpu_range, n))
    cpu = tuple(cpu_range[:n])
    return TransferJob(kind, gpu, cpu)


def run_job(engine: CudaTransferEngine, job: TransferJob) -> None:
    job_id = engine.submit(job)
    engine.wait([job_id])
    engine.poll()


def bench_swaps(engine: CudaTransferEngine, peaks: dict[str, float], rng: random.Random) -> list[dict]:
    records = []
    block_bytes = engine.block_bytes
    for tokens in (2048, 8192, 32768):
        for kind, peak_key in (("d2h", "d2h_peak_gbs"), ("h2d", "h2d_peak_gbs")):
            job = swap_job(kind, tokens, rng, range(POOL_BLOCKS), range(CPU_BLOCKS))
            seconds = time_cuda(lambda job=job: run_job(engine, job), reps=5)
            gbs = len(job.gpu_block_ids) * block_bytes / seconds / 1e9
            name = f"swap-{'out' if kind == 'd2h' else 'in'} {tokens} tokens ({len(job.gpu_block_ids)} blocks)"
            records.append(report(name, gbs, "GB/s", peaks[peak_key], f"pinned {kind}"))
    tokens = 16384
    out_job = swap_job("d2h", tokens, rng, range(0, POOL_BLOCKS // 2), range(0, CPU_BLOCKS // 2))
    in_job = swap_job("h2d", tokens, rng, range(POOL_BLOCKS // 2, POOL_BLOCKS), range(CPU_BLOCKS // 2, CPU_BLOCKS))

    def both() -> None:
        ids = [engine.submit(out_job), engine.submit(in_job)]
        engine.wait(ids)
        engine.poll()

    seconds = time_cuda(both, reps=5)
    gbs = 2 * len(out_job.gpu_block_ids) * block_bytes / seconds / 1e9
    records.append(report(f"swap-out + swap-in at once, {tokens} tokens each", gbs, "GB/s",
                          peaks["two_way_peak_gbs"], "pinned two-way"))
    return records


def step_beside_swap(engine: CudaTransferEngine, job: TransferJob, step: Callable[[], object], reps: int) -> float:
    """Median seconds of `step` timed alone on the GPU while `job` runs beside it (submitted
    just before each step)."""
    times = []
    for _ in range(reps):
        job_id = engine.submit(job)
        times.append(time_cuda(step, reps=1, warmup=0))
        engine.wait([job_id])
        engine.poll()
    return sorted(times)[reps // 2]


def bench_decode_during_swap(engine: CudaTransferEngine, rng: random.Random) -> list[dict]:
    from decode_step import DecodeStep

    step = DecodeStep(batch=32, context=2048)
    alone = time_cuda(step, reps=10)
    job = swap_job("d2h", 32768, rng, range(POOL_BLOCKS), range(CPU_BLOCKS))

    slowed = step_beside_swap(engine, job, step, reps=10)
    return [
        report("decode step llama-3-8b, batch 32, ctx 2048", alone * 1e3, "ms"),
        report("same, with a 32k-token swap-out beside it", slowed * 1e3, "ms", alone * 1e3, "decode alone"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", action="store_true", help="also time a decode step during a swap")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    require_cuda()
    rng = random.Random(0)
    peaks = pinned_peaks()
    for key, value in peaks.items():
        report(key, value, "GB/s")
    engine, tier = build()
    records = bench_swaps(engine, peaks, rng)
    if args.decode:
        records += bench_decode_during_swap(engine, rng)
    tier.close()
    write_json(args.json, records)


if __name__ == "__main__":
    main()
