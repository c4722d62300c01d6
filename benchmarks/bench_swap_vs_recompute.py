"""Swap vs recompute across context lengths, and what `auto` decides.

For each context length (256 to 32k tokens of the `llama-3-8b` preset, bf16): the measured
time to swap the sequence out and back in (D2H + H2D of its blocks through the transfer
engine), the measured time to recompute it (one prefill of the whole context), the choice of
`auto` under the cost model calibrated at start-up, and the check that `auto` is never more
than 5% slower than the better fixed policy. Pinned-copy peaks of the same run are printed.

    python benchmarks/bench_swap_vs_recompute.py [--json out.json]
"""

from __future__ import annotations

import argparse
import random

from common import pinned_peaks, report, require_cuda, time_cuda, write_json

from tieredkv.calibrate import fit_prefill, measure_bandwidth
from tieredkv.config import ModelConfig
from tieredkv.model.runner import ModelRunner
from tieredkv.policy import CostModel, choose_preemption
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.cuda import CudaTransferEngine
from tieredkv.transfer.engine import TransferJob

LENGTHS = (256, 1024, 4096, 8192, 16384, 32768)
BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    require_cuda()
    peaks = pinned_peaks()
    for key, value in peaks.items():
        report(key, value, "GB/s")
    runner = ModelRunner(ModelConfig(model="llama-3-8b", device="cuda", dtype="bfloat16"))
    num_blocks = 2 * max(LENGTHS) // BLOCK_SIZE + 16
    kv = runner.allocate_kv_cache(num_blocks, BLOCK_SIZE)
    tier = CPUTier(max(LENGTHS) // BLOCK_SIZE, tuple(kv[:, :, 0].shape), kv.dtype, pin=True)
    engine = CudaTransferEngine(kv, tier.data)
    block_bytes = engine.block_bytes

    # the cost model, calibrated the way the engine does it at start-up
    d2h, h2d = measure_bandwidth(kv.device)
    t1 = time_cuda(lambda: runner.prefill_probe(256), reps=3)
    t2 = time_cuda(lambda: runner.prefill_probe(1024), reps=3)
    cost = CostModel(d2h, h2d, *fit_prefill(256, t1, 1024, t2))
    print(f"calibrated cost model: {cost}")

    rng = random.Random(0)
    records, worst = [], 0.0
    for tokens in LENGTHS:
        n = tokens // BLOCK_SIZE
        gpu = tuple(rng.sample(range(num_blocks), n))
        cpu = tuple(range(n))

        def swap(gpu: tuple[int, ...] = gpu, cpu: tuple[int, ...] = cpu) -> None:
            ids = [engine.submit(TransferJob("d2h", gpu, cpu))]
            ids.append(engine.submit(TransferJob("h2d", gpu, cpu)))
            engine.wait(ids)
            engine.poll()

        swap_s = time_cuda(swap, reps=3)
        recompute_s = time_cuda(lambda tokens=tokens: runner.prefill_probe(tokens), reps=3, warmup=1)
        choice = choose_preemption("auto", tokens, n, block_bytes, n, cost)
        chosen_s = swap_s if choice == "swap" else recompute_s
        best = min(swap_s, recompute_s)
        worst = max(worst, chosen_s / best)
        swap_gbs = 2 * n * block_bytes / swap_s / 1e9
        print(f"{tokens:>6} tokens: swap out+in {swap_s * 1e3:8.2f} ms ({swap_gbs:5.1f} GB/s)  "
              f"recompute {recompute_s * 1e3:8.2f} ms  auto -> {choice:<9} "
              f"({chosen_s / best:.3f}x the better)", flush=True)
        records.append({"tokens": tokens, "swap_s": swap_s, "recompute_s": recompute_s, "auto": choice,
                        "auto_over_best": chosen_s / best})
    verdict = "PASS" if worst <= 1.05 else "FAIL"
    print(f"auto vs the better fixed policy, worst case: {worst:.3f}x (target <= 1.05): {verdict}")
    tier.close()
    write_json(args.json, records)


if __name__ == "__main__":
    main()
