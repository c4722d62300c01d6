"""Swap bandwidth of the transfer engine against the pinned-copy peaks of the same run.

- swap-out and swap-in of one sequence of 2k, 8k and 32k tokens of Llama-3-8B KV scattered
  over the GPU pool (target: >= 95% of the pinned peak each way);
- a swap-out and a swap-in at the same time (target: >= 90% of the two-way peak);
- with --decode: the engine's decode step of the `llama-3-8b` preset (a CUDA graph, batch 64,
  context 2048) with and without a 32k-token swap running beside it (target: at most 5% slower).

Each swap is timed three ways:
- "GPU time, queued behind a sleep": from the moment the job's streams may start to the moment
  all of them are done, with everything submitted while a GPU sleep holds them back, as in the
  engine, which submits a step's transfers while the GPU runs the previous step. A run whose
  host submit outlasted the sleep would count the GPU's wait for it: that is checked and said.
- "from the submit call": the clock starts before the Python submit on an idle GPU, so its host
  work (about 0.3-0.8 ms) is on the critical path: a lower bound that moves with host jitter.
- "GPU activity": the same submit as the line above, traced by the profiler (CUPTI): from the
  start of the jobs' first copy or kernel on the GPU to the end of their last one.
The three agree for one job. For a swap-out and a swap-in at once they time two different
executions, and the two-way case prints, from the trace of each, how long each direction's
copies ran, how much of the shorter one ran beside the other (the concurrency: 100% when the
copy engines work both ways at once), and how late the second direction began. On the H200
(2026-11-23, BENCHMARKS.md): submitted from the call, the directions ran side by side (93%, the
second 3 ms after the first: 91-95% of the two-way peak); queued behind a sleep, they took
turns (51%, the second 20 ms after the first: 53-70%), with 8 hardware connections and with 32
alike, so sharing a hardware queue is not the cause. The GPU-time figure is a true clock of
that queued execution, not a faulty one.
`--max-connections N` sets CUDA_DEVICE_MAX_CONNECTIONS for the run (before CUDA starts), to
compare. `--repeat N` runs the swap figures N times back to back, each against pinned peaks
measured just before it, and ends with the two-way figure of each run by each method.

    python benchmarks/bench_transfer.py [--repeat 5] [--max-connections 32] [--decode] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import (
    LLAMA8B_BLOCK_SHAPE,
    pinned_peaks,
    report,
    require_cuda,
    time_cuda,
    write_json,
)
from gpu_activity import Op, TwoWay, span_s, trace

from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.cuda import CudaTransferEngine
from tieredkv.transfer.engine import TransferJob

BLOCK_SIZE = 16
SLEEP_CYCLES = 20_000_000  # about 10 ms of GPU sleep: longer than the host submit of a 32k-token job
POOL_BLOCKS = 4608  # 9 GiB of GPU KV, 2 MiB a block
CPU_BLOCKS = 4608
TARGET_TWO_WAY = 0.90
TWO_WAY_TOKENS = 16384  # each way


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


@dataclass(frozen=True)
class SleepTiming:
    seconds: float  # from the release of the engine's streams to the end of the jobs
    submit_hidden: bool  # the host had submitted everything before the sleep ended


def gpu_seconds(engine: CudaTransferEngine, jobs: list[TransferJob]) -> SleepTiming:
    """Seconds from the release of the engine's streams to the end of `jobs`, submitted while
    the GPU sleeps; and whether the submit ended before the sleep did (if not, the GPU's wait
    for the host is counted)."""
    compute = torch.cuda.current_stream()
    torch.cuda.synchronize()
    asleep, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    host_start = time.perf_counter()
    asleep.record(compute)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record(compute)
    for stream in engine.streams:  # nothing of the jobs may start before `start`
        stream.wait_stream(compute)
    job_ids = [engine.submit(job) for job in jobs]
    for stream in engine.streams:  # `end` comes after everything the jobs queued
        compute.wait_stream(stream)
    host_s = time.perf_counter() - host_start
    end.record(compute)
    end.synchronize()
    engine.wait(job_ids)
    engine.poll()
    return SleepTiming(start.elapsed_time(end) / 1e3, host_s < asleep.elapsed_time(start) / 1e3)


def median_gpu_seconds(engine: CudaTransferEngine, jobs: list[TransferJob], reps: int = 7) -> float:
    gpu_seconds(engine, jobs)  # warm-up
    timings = [gpu_seconds(engine, jobs) for _ in range(reps)]
    late = sum(not t.submit_hidden for t in timings)
    if late:
        print(f"    warning: in {late} of {reps} runs the host submit outlasted the {SLEEP_CYCLES:,}-cycle GPU "
              "sleep, so the GPU waited for the host and that wait is counted: raise SLEEP_CYCLES", flush=True)
    return statistics.median(t.seconds for t in timings)


def job_ops(ops: list[Op]) -> list[Op]:
    """The traced operations of the jobs: all but the GPU sleep (`torch.cuda._sleep`'s spin kernel)."""
    return [op for op in ops if "spin_kernel" not in op.name]


def traced(engine: CudaTransferEngine, jobs: list[TransferJob], behind_sleep: bool = False) -> list[Op]:
    """The jobs' operations on the GPU, submitted from the submit call or queued behind a sleep."""
    return job_ops(trace(lambda: gpu_seconds(engine, jobs) if behind_sleep else run_jobs(engine, jobs)))


def median_traced_seconds(engine: CudaTransferEngine, jobs: list[TransferJob], reps: int = 3) -> float:
    """Median GPU-activity span of `jobs` submitted from the submit call."""
    traced(engine, jobs)  # warm-up (the profiler's own start-up too)
    return statistics.median(span_s(traced(engine, jobs)) for _ in range(reps))


def run_jobs(engine: CudaTransferEngine, jobs: list[TransferJob]) -> None:
    engine.wait([engine.submit(job) for job in jobs])
    engine.poll()


METHODS = {  # key: how the figure is named in the output
    "sleep": "GPU time, queued behind a sleep",
    "submit": "from the submit call",
    "activity": "GPU activity (profiler), from the submit call",
}


def two_way_jobs(rng: random.Random) -> list[TransferJob]:
    """A swap-out and a swap-in of TWO_WAY_TOKENS each, on disjoint GPU and CPU blocks."""
    return [swap_job("d2h", TWO_WAY_TOKENS, rng, range(0, POOL_BLOCKS // 2), range(0, CPU_BLOCKS // 2)),
            swap_job("h2d", TWO_WAY_TOKENS, rng, range(POOL_BLOCKS // 2, POOL_BLOCKS),
                     range(CPU_BLOCKS // 2, CPU_BLOCKS))]


def bench_swaps(engine: CudaTransferEngine, peaks: dict[str, float], rng: random.Random,
                activity: bool = True) -> list[dict]:
    """Every swap figure by each method (the profiler's only with `activity`), and for the
    two-way case the trace of both executions."""
    records = []
    cases = [
        (f"swap-{'out' if kind == 'd2h' else 'in'} {tokens} tokens ({tokens // BLOCK_SIZE} blocks)",
         [swap_job(kind, tokens, rng, range(POOL_BLOCKS), range(CPU_BLOCKS))], f"{kind}_peak_gbs", f"pinned {kind}")
        for tokens in (2048, 8192, 32768) for kind in ("d2h", "h2d")
    ]
    cases.append((f"swap-out + swap-in at once, {TWO_WAY_TOKENS} tokens each", two_way_jobs(rng),
                  "two_way_peak_gbs", "pinned two-way"))
    for name, jobs, peak_key, peak_name in cases:
        num_bytes = sum(len(job.gpu_block_ids) for job in jobs) * engine.block_bytes
        seconds = {"sleep": median_gpu_seconds(engine, jobs),
                   "submit": time_cuda(lambda jobs=jobs: run_jobs(engine, jobs), reps=7)}
        if activity:
            seconds["activity"] = median_traced_seconds(engine, jobs)
        for method, s in seconds.items():
            record = report(f"{name}, {METHODS[method]}", num_bytes / s / 1e9, "GB/s", peaks[peak_key], peak_name)
            records.append({**record, "case": "two-way" if len(jobs) == 2 else name, "method": method})
        if len(jobs) == 2 and activity:
            records += two_way_evidence(engine, jobs)
    return records


def two_way_evidence(engine: CudaTransferEngine, jobs: list[TransferJob]) -> list[dict]:
    """How the two directions' copies ran, traced from the submit call and queued behind a sleep."""
    records = []
    for method, behind_sleep in (("submit", False), ("sleep", True)):
        traced(engine, jobs, behind_sleep)  # warm-up
        two = TwoWay.of(traced(engine, jobs, behind_sleep))
        print(f"    traced, {METHODS[method]}: D2H copies {two.d2h_s * 1e3:.1f} ms, H2D {two.h2d_s * 1e3:.1f} ms, "
              f"side by side {two.both_s * 1e3:.1f} ms = {two.concurrency:.0%} of the shorter; the second "
              f"direction began {two.later_start_s * 1e3:.2f} ms after the first", flush=True)
        records.append({"case": "two-way", "method": method, "evidence": {
            "d2h_s": two.d2h_s, "h2d_s": two.h2d_s, "both_s": two.both_s, "concurrency": two.concurrency,
            "later_start_s": two.later_start_s}})
    return records


def two_way_table(runs: list[list[dict]]) -> list[str]:
    """Per run, the two-way figure's ratio to its peak by each method, and the concurrency of
    its copies; then how many runs held the target by every method."""
    lines = [f"two-way ({TWO_WAY_TOKENS} tokens each way), ratio to the pinned two-way peak of the same run:"]
    held = 0
    for i, records in enumerate(runs, 1):
        ratios = {r["method"]: r["value"] / r["peak"] for r in records if r.get("case") == "two-way" and "value" in r}
        concurrency = {r["method"]: r["evidence"]["concurrency"] for r in records if "evidence" in r}
        cells = [f"{METHODS[m]} {ratios[m]:.1%}" + (f" (copies side by side {concurrency[m]:.0%})"
                                                     if m in concurrency else "") for m in METHODS if m in ratios]
        ok = all(r >= TARGET_TWO_WAY for r in ratios.values())
        held += ok
        lines.append(f"  run {i}: " + "; ".join(cells) + f"  [{'PASS' if ok else 'FAIL'}]")
    lines.append(f"  >= {TARGET_TWO_WAY:.0%} by every method in {held} of {len(runs)} runs")
    return lines


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
    parser.add_argument("--repeat", type=int, default=1, help="run the swap figures this many times back to back")
    parser.add_argument("--max-connections", type=int,
                        help="set CUDA_DEVICE_MAX_CONNECTIONS (hardware queues per GPU) for this run")
    parser.add_argument("--no-trace", action="store_true", help="skip the profiler's GPU-activity figures")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.max_connections is not None:  # read when CUDA starts, so before anything touches it
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(args.max_connections)
    require_cuda()
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '8 (unset: the default)')}")
    rng = random.Random(0)
    peaks = pinned_peaks()  # before the engine, as always: it takes the next streams of torch's pool
    engine, tier = build()
    print("transfer streams (torch stream ids): " + ", ".join(
        f"{name} {stream.stream_id}" for name, stream in zip(
            ("D2H gather", "D2H copy", "H2D copy", "H2D scatter"), engine.streams, strict=True)))
    runs, records = [], []
    for i in range(args.repeat):
        if args.repeat > 1:
            print(f"== run {i + 1} of {args.repeat} ==", flush=True)
        peaks = peaks if i == 0 else pinned_peaks()
        for key, value in peaks.items():
            report(key, value, "GB/s")
        runs.append(bench_swaps(engine, peaks, rng, activity=not args.no_trace))
        records += [{**r, "run": i + 1} for r in runs[-1]]
    print("\n".join(two_way_table(runs)))
    if args.decode:
        records += bench_decode_during_swap(engine, rng)
    tier.close()
    write_json(args.json, records)


if __name__ == "__main__":
    main()
