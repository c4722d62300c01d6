"""CPU cost of the block manager and the scheduler (no model, no GPU).

Measures
- per-block cost of allocate, free and prefix match;
- the CPU time of one scheduler step with 256 running sequences of 2,048 tokens each
  (schedule + the bookkeeping the engine does after the forward pass; median and p90 of the
  steps, as the machine's noise moves the mean). Target: < 1 ms.

    python benchmarks/bench_scheduler.py [--seqs 256] [--context 2048] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import time

from tieredkv.cache.manager import KVCacheManager
from tieredkv.config import SchedulerConfig
from tieredkv.policy import TierPolicy
from tieredkv.sampling import SamplingParams
from tieredkv.scheduler import Scheduler
from tieredkv.sequence import Sequence

BLOCK_SIZE = 16


def make_seq(i: int, n: int, rng: random.Random) -> Sequence:
    return Sequence(str(i), [rng.randrange(50_000) for _ in range(n)], SamplingParams(max_tokens=10**6))


def bench_blocks(num_seqs: int, context: int, rng: random.Random) -> dict[str, float]:
    blocks_per_seq = context // BLOCK_SIZE
    kv = KVCacheManager(num_seqs * blocks_per_seq, BLOCK_SIZE, root_hash=1)
    seqs = [make_seq(i, context, rng) for i in range(num_seqs)]
    t0 = time.perf_counter()
    for seq in seqs:
        kv.allocate(seq, context, kv.match_prefix(seq))
    t1 = time.perf_counter()
    for seq in seqs:
        seq.num_computed_tokens = context
        kv.commit(seq)
    for seq in seqs:
        kv.free(seq)
    t2 = time.perf_counter()
    again = [make_seq(i, context, random.Random(0)) for i in range(num_seqs)]  # fresh hashes to compute
    for seq, old in zip(again, seqs, strict=True):
        seq.token_ids = list(old.token_ids)
    t3 = time.perf_counter()
    matched = sum(len(kv.match_prefix(seq).gpu_blocks) for seq in again)
    t4 = time.perf_counter()
    total = num_seqs * blocks_per_seq
    return {
        "allocate (incl. miss lookup + hash)": (t1 - t0) / total,
        "commit + free": (t2 - t1) / total,
        "match (hit, incl. hash)": (t4 - t3) / max(matched, 1),
    }


def bench_step(num_seqs: int, context: int, steps: int, rng: random.Random) -> list[float]:
    blocks = num_seqs * (context // BLOCK_SIZE + steps // BLOCK_SIZE + 2)
    kv = KVCacheManager(blocks, BLOCK_SIZE, root_hash=1)
    config = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * context)
    scheduler = Scheduler(config, kv, TierPolicy("recompute", block_bytes=0))
    for i in range(num_seqs):
        scheduler.add(make_seq(i, context, rng))
    admit = scheduler.schedule()  # prefill everything once, outside the timing
    scheduler.update(admit, [1] * len(admit.sampling))
    times = []
    for step in range(steps):
        start = time.perf_counter()
        out = scheduler.schedule()
        assert len(out.scheduled) == num_seqs and not out.preempted
        for item in out.scheduled:
            kv.block_table(item.seq)
        scheduler.update(out, [step % 1000] * len(out.sampling))
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    for name, seconds in bench_blocks(args.seqs, args.context, rng).items():
        print(f"{name:<38} {seconds * 1e6:8.2f} us/block")
    times = sorted(bench_step(args.seqs, args.context, args.steps, rng))
    median, p90 = times[len(times) // 2], times[int(len(times) * 0.9)]
    print(f"scheduler step, {args.seqs} seqs x {args.context} tokens: median {median * 1e3:.3f} ms, "
          f"p90 {p90 * 1e3:.3f} ms, mean {sum(times) / len(times) * 1e3:.3f} ms (target < 1 ms)")


if __name__ == "__main__":
    main()
