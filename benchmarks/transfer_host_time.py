"""Host time of `CudaTransferEngine.submit`, and how many copies a stream queues before the
host blocks.

Submit: jobs of 4, 16 and 64 Llama-3-8B blocks (2 MiB each), GPU blocks at random, CPU blocks
either at random (one DMA a block) or consecutive (one DMA a job), in turn H2D and D2H; the GPU
idle, or busy (every 20th job queues ~100 ms of sleep on the compute stream, which the
transfers wait for) with up to 64 or 8 jobs pending. Then the host time of the single calls a
job is made of (pinning its block ids, their copy to the GPU, an event, one DMA, a stream
wait), idle and busy.

Profile (`--profile`): 600 idle jobs of 4 or 16 consecutive blocks, their submits under
`cProfile`: the functions that take the host's time (own time and with what they call).

Serving (`--serving`): steps as the engine runs them on multi_turn_8b's store variant, where
a job cost 1.55 ms (D2H) and 1.88 ms (H2D) of host time against 0.3-0.9 ms above: each step
queues ~7 ms of compute, submits a D2H job of 67 blocks in runs of 6 consecutive CPU blocks and
an H2D job of 236 blocks in runs of 14 (the mean sizes seen there, and the runs simulated),
orders the compute after them and waits for the step, as the engine's sampling does. With
`--profile`, under cProfile.

Queue depth (`--queue-depth`): a stream waits for a 200 ms GPU sleep while the host queues
1-row copies (or kernels, or events) on it; prints after how many the host blocked.

    python benchmarks/transfer_host_time.py [--long] [--queue-depth] [--serving] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch
from bench_transfer import build
from common import require_cuda

from tieredkv.transfer.engine import TransferJob

POOL_BLOCKS, CPU_BLOCKS = 4096, 2048
SLEEP_CYCLES = 200_000_000  # ~100 ms of GPU sleep
STEP_CYCLES = 14_000_000  # ~7 ms: a decode step's forward pass on multi_turn_8b
SERVING_JOBS = (("d2h", 67, 6), ("h2d", 236, 14))  # kind, blocks, consecutive CPU blocks a run


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"n={len(xs)} mean {statistics.mean(xs) * 1e3:.3f} p50 {xs[len(xs) // 2] * 1e3:.3f} "
            f"p90 {xs[int(len(xs) * .9)] * 1e3:.3f} max {xs[-1] * 1e3:.3f} ms")


class SubmitCost:
    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.engine, self.tier = build(POOL_BLOCKS, CPU_BLOCKS)
        torch.cuda.synchronize()

    def job(self, kind: str, n: int, fragmented: bool) -> TransferJob:
        gpu = tuple(self.rng.sample(range(POOL_BLOCKS), n))
        if fragmented:
            cpu = tuple(self.rng.sample(range(CPU_BLOCKS), n))
        else:
            start = self.rng.randrange(CPU_BLOCKS - n)
            cpu = tuple(range(start, start + n))
        return TransferJob(kind, gpu, cpu)

    def timed_submit(self, job: TransferJob, profiler: cProfile.Profile | None) -> float:
        """Submit `job` (under `profiler` too, if given); the seconds the submit took."""
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        self.engine.submit(job)
        took = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        return took

    def job_in_runs(self, kind: str, n: int, run: int) -> TransferJob:
        """A job of `n` random GPU blocks into (or from) runs of `run` consecutive CPU blocks."""
        gpu = tuple(self.rng.sample(range(POOL_BLOCKS), n))
        starts = self.rng.sample(range(CPU_BLOCKS // run), -(-n // run))
        cpu = tuple(start * run + i for start in starts for i in range(run))[:n]
        return TransferJob(kind, gpu, cpu)

    def serving(self, steps: int = 200, profiler: cProfile.Profile | None = None) -> None:
        """Time the submits of `steps` engine-like steps (module docstring)."""
        engine = self.engine
        times: dict[str, list[float]] = {kind: [] for kind, _, _ in SERVING_JOBS}
        for _ in range(steps):
            torch.cuda._sleep(STEP_CYCLES)  # this step's forward pass, launched before the next step's jobs
            engine.poll()
            for kind, n, run in SERVING_JOBS:
                times[kind].append(self.timed_submit(self.job_in_runs(kind, n, run), profiler))
            engine.order_compute()
            torch.cuda.current_stream().synchronize()  # the sampling's wait for the step
        torch.cuda.synchronize()
        engine.poll()
        label = "serving" + (", under cProfile" if profiler is not None else "")
        for kind, n, run in SERVING_JOBS:
            print(f"{label:28s} {kind} {n:3d} blocks in runs of {run:2d}: {_ms(times[kind])}", flush=True)

    def submits(self, label: str, busy: bool, pending_cap: int, fragmented: bool,
                sizes: tuple[int, ...] = (4, 16, 64), count: int = 120,
                profiler: cProfile.Profile | None = None) -> None:
        """Time `count` jobs (under `profiler` too, if given: the submits only)."""
        engine = self.engine
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for rep in range(count):
            if busy and rep % 20 == 0:
                torch.cuda._sleep(SLEEP_CYCLES)
            n = sizes[rep % len(sizes)]
            times[n].append(self.timed_submit(self.job("d2h" if rep % 2 else "h2d", n, fragmented), profiler))
            engine.order_compute()
            if len(engine._pending) > pending_cap:
                engine.poll()
        torch.cuda.synchronize()
        engine.poll()
        for n in sizes:
            print(f"{label:40s} blocks {n:3d}: {_ms(times[n])}", flush=True)

    def profile(self, count: int = 600, serving: bool = False) -> None:
        profiler = cProfile.Profile()
        if serving:
            self.serving(count // 2, profiler)
        else:
            self.submits("under cProfile, idle, consecutive", False, 8, False, sizes=(4, 16), count=count,
                         profiler=profiler)
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)

    def parts(self, busy: bool) -> None:
        ids = [self.rng.randrange(POOL_BLOCKS) for _ in range(32)]
        names = ("tensor+pin", "to(cuda)", "event rec", "dma launch", "wait_event")
        res: dict[str, list[float]] = {name: [] for name in names}
        side = torch.cuda.Stream()
        slot = self.engine.d2h.slots[0]
        for rep in range(200):
            if busy and rep % 50 == 0:
                torch.cuda._sleep(SLEEP_CYCLES)
                side.wait_stream(torch.cuda.current_stream())
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                host = torch.tensor(ids, dtype=torch.int64).pin_memory()
                t1 = time.perf_counter()
                host.to("cuda", non_blocking=True)
                t2 = time.perf_counter()
                event = torch.cuda.Event()
                event.record(side)
                t3 = time.perf_counter()
                self.tier.data[5:7].copy_(slot[0:2], non_blocking=True)
                t4 = time.perf_counter()
                torch.cuda.current_stream().wait_event(event)
                t5 = time.perf_counter()
            for key, value in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                res[key].append(value)
        torch.cuda.synchronize()
        for key, values in res.items():
            print(f"part {'busy' if busy else 'idle'} {key:12s}: {_ms(values)}", flush=True)


def queue_depth() -> None:
    host = torch.empty((4096, 1024), dtype=torch.uint8).pin_memory()
    gpu = torch.empty((4096, 1024), dtype=torch.uint8, device="cuda")
    for label in ("dma d2h", "dma h2d", "kernel", "event"):
        held, queued = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(held):
            torch.cuda._sleep(2 * SLEEP_CYCLES)
        queued.wait_stream(held)
        blocked_at = None
        start = time.perf_counter()
        with torch.cuda.stream(queued):
            for i in range(6000):
                t0 = time.perf_counter()
                if label == "dma d2h":
                    host[i % 4096].copy_(gpu[i % 4096], non_blocking=True)
                elif label == "dma h2d":
                    gpu[i % 4096].copy_(host[i % 4096], non_blocking=True)
                elif label == "kernel":
                    gpu[i % 4096].add_(1)
                else:
                    torch.cuda.Event().record(queued)
                if time.perf_counter() - t0 > 0.02:
                    blocked_at = i
                    break
        took_ms = (time.perf_counter() - start) * 1e3
        print(f"{label}: host blocked after {blocked_at} ops ({took_ms:.0f} ms)", flush=True)
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="end with 1,200 busy fragmented jobs (to profile)")
    parser.add_argument("--queue-depth", action="store_true", help="only the queue-depth probe")
    parser.add_argument("--profile", action="store_true", help="only the profile of a submit's host time")
    parser.add_argument("--serving", action="store_true", help="only engine-like steps (with --profile: profiled)")
    args = parser.parse_args()
    require_cuda()
    if args.queue_depth:
        queue_depth()
        return
    bench = SubmitCost()
    bench.submits("warmup", False, 4, True, count=30)
    if args.profile:
        bench.profile(serving=args.serving)
        return
    if args.serving:
        bench.serving()
        return
    bench.submits("idle, fragmented", False, 1000, True)
    bench.submits("idle, consecutive", False, 1000, False)
    bench.submits("busy, fragmented, pending<=64", True, 64, True)
    bench.submits("busy, consecutive, pending<=64", True, 64, False)
    bench.submits("busy, fragmented, pending<=8", True, 8, True)
    bench.parts(False)
    bench.parts(True)
    if args.long:
        bench.submits("busy, fragmented, long", True, 64, True, count=1200)


if __name__ == "__main__":
    main()
