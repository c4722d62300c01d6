"""Swap bandwidth of the transfer engine against the pinned-copy peaks of the same run.

- swap-out and swap-in of one sequence of 2k, 8k and 32k tokens of Llama-3-8B KV scattered
  over the GPU pool (target: >= 95% of the pinned peak each way);
- a swap-out and a swap-in at the same time (target: >= 90% of the two-way peak);
- with --decode: the engine's decode step of the `llama-3-8b` preset (a CUDA graph, batch 64,
  context 2048) with and without a 32k-token swap running beside it (target: at most 5% slower).

Each swap is timed two ways. "GPU time" runs from the moment the job's streams may start to the
moment all of them are done, with the host-side submit hidden behind a GPU sleep, as in the
engine, which submits a step's transfers while the GPU runs the previous step: the bandwidth of
the data path, the figure the targets judge. "From the submit call" starts the clock before the
Python submit on an idle GPU, so its host work (about 0.3-0.8 ms) is on the critical path: a
lower bound that moves with host jitter, reported beside it.

    python benchmarks/bench_transfer.py [--decode] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
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
from tieredkv.transfer.cuda import CudaTransferEngine
from tieredkv.transfer.engine import TransferJob

BLOCK_SIZE = 16
SLEEP_CYCLES = 20_000_000  # about 10 ms of GPU sleep: longer than the host submit of a 32k-token job
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


def gpu_seconds(engine: CudaTransferEngine, jobs: list[TransferJob]) -> float:
    """Seconds from the release of the engine's streams to the end of `jobs`, submitted while
    the GPU sleeps (if the submit outlasted the sleep, the GPU's wait for it would be counted)."""
    compute = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(compute)
    for stream in engine.streams:  # nothing of the jobs may start before `start`
        stream.wait_stream(compute)
    job_ids = [engine.submit(job) for job in jobs]
    for stream in engine.streams:  # `end` comes after everything the jobs queued
        compute.wait_stream(stream)
    end.record(compute)
    end.synchronize()
    engine.wait(job_ids)
    engine.poll()
    return start.elapsed_time(end) / 1e3


def median_gpu_seconds(engine: CudaTransferEngine, jobs: list[TransferJob], reps: int = 7) -> float:
    gpu_seconds(engine, jobs)  # warm-up
    return statistics.median(gpu_seconds(engine, jobs) for _ in range(reps))


def run_jobs(engine: CudaTransferEngine, jobs: list[TransferJob]) -> None:
    engine.wait([engine.submit(job) for job in jobs])
    engine.poll()


def bench_swaps(engine: CudaTransferEngine, peaks: dict[str, float], rng: random.Random) -> list[dict]:
    records = []
    block_bytes = engine.block_bytes
    half = 16384
    out_job = swap_job("d2h", half, rng, range(0, POOL_BLOCKS // 2), range(0, CPU_BLOCKS // 2))
    in_job = swap_job("h2d", half, rng, range(POOL_BLOCKS // 2, POOL_BLOCKS), range(CPU_BLOCKS // 2, CPU_BLOCKS))
    cases = [
        (f"swap-{'out' if kind == 'd2h' else 'in'} {tokens} tokens ({tokens // BLOCK_SIZE} blocks)",
         [swap_job(kind, tokens, rng, range(POOL_BLOCKS), range(CPU_BLOCKS))], f"{kind}_peak_gbs", f"pinned {kind}")
        for tokens in (2048, 8192, 32768) for kind in ("d2h", "h2d")
    ]
    cases.append((f"swap-out + swap-in at once, {half} tokens each", [out_job, in_job],
                  "two_way_peak_gbs", "pinned two-way"))
    for name, jobs, peak_key, peak_name in cases:
        num_bytes = sum(len(job.gpu_block_ids) for job in jobs) * block_bytes
        gpu = num_bytes / median_gpu_seconds(engine, jobs) / 1e9
        records.append(report(f"{name}, GPU time", gpu, "GB/s", peaks[peak_key], peak_name))
        wall = num_bytes / time_cuda(lambda jobs=jobs: run_jobs(engine, jobs), reps=7) / 1e9
        records.append(report(f"{name}, from the submit call", wall, "GB/s", peaks[peak_key], peak_name))
    return records


def slowdown_beside(engine: CudaTransferEngine, job: TransferJob, step: Callable[[], object],
                    pairs: int = 25) -> list[float]:
    """`pairs` ratios of `step` timed while `job` runs beside it (submitted just before the
    step) over `step` timed alone just before: back to back, so clock drift cancels out."""
    for _ in range(3):
        step()
    ratios = []
    for _ in range(pairs):
        alone = time_cuda(step, reps=1, warmup=0)
        job_id = engine.submit(job)
        beside = time_cuda(step, reps=1, warmup=0)
        engine.wait([job_id])
        engine.poll()
        ratios.append(beside / alone)
    return ratios


def bench_decode_during_swap(engine: CudaTransferEngine, rng: random.Random) -> list[dict]:
    from decode_step import DecodeStep

    step = DecodeStep(batch=64, context=2048)
    step.runner.capture_graphs(64, max_mixed_tokens=0)
    alone = time_cuda(step, reps=10)
    records = [report("decode step llama-3-8b, CUDA graph, batch 64, ctx 2048", alone * 1e3, "ms")]
    for kind in ("d2h", "h2d"):
        job = swap_job(kind, 32768, rng, range(POOL_BLOCKS), range(CPU_BLOCKS))
        ratios = slowdown_beside(engine, job, step)
        name = f"same, beside a 32k-token swap-{'out' if kind == 'd2h' else 'in'} (median of {len(ratios)} pairs)"
        records.append(report(name, statistics.median(ratios) * alone * 1e3, "ms", alone * 1e3, "step alone"))
        print(f"    slowdown per pair: min {min(ratios) - 1:+.1%}, median {statistics.median(ratios) - 1:+.1%}, "
              f"max {max(ratios) - 1:+.1%}")
    return records


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
