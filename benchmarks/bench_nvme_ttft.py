"""Time to first token when a long prefix sits on NVMe: load it, recompute it, or both at once.

For prefixes of 16k, 32k and 64k tokens of the `llama-3-8b` preset (random bf16 weights): the
prefix's KV blocks are computed once and written to the NVMe store, the GPU and CPU prefix
caches are dropped, and a request of prefix + a 64-token question is served three ways:
- load-only: every prefix block read from disk (NVMe -> CPU -> GPU);
- recompute-only: the prefix prefilled again;
- load-and-recompute: the first blocks computed while the later ones are read, split by the
  cost model calibrated in this run (disk read bandwidth, PCIe, prefill time).
Target: load-and-recompute beats the better of the other two. The disk's sequential O_DIRECT
read bandwidth and the pinned H2D peak of the same run are printed.

    python benchmarks/bench_nvme_ttft.py --dir /tmp/tieredkv-nvme [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import time

import torch
from common import pinned_peaks, report, require_cuda, write_json

from tieredkv import LLM, SamplingParams
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.calibrate import fit_prefill, measure_bandwidth, measure_disk_read
from tieredkv.policy import CostModel
from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.nvme.slot_format import aligned_empty

LENGTHS = (16384, 32768, 65536)
QUESTION = 64
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def spill_prompt_blocks(llm: LLM, prompt: list[int]) -> int:
    """Write the prompt's cached GPU blocks to the NVMe store (as a long-idle engine would
    have spilled them); returns how many were written."""
    kv, store = llm.kv, llm.kv.offload.nvme.store
    block = kv.offload.tier.data[0]
    staging = aligned_empty(block.numel() * block.element_size()).view(block.dtype).view(block.shape)
    hashes = extend_block_hashes([], prompt, kv.block_size, kv.root_hash)
    jobs, parent = [], kv.root_hash
    for i, block_hash in enumerate(hashes):
        tokens = prompt[i * kv.block_size : (i + 1) * kv.block_size]
        block = kv.pool.lookup(block_hash, parent, tokens)
        assert block is not None, "the prompt's blocks must still be cached on the GPU"
        staging.copy_(llm.runner.kv_cache[:, :, block.block_id])
        job = store.submit_write(BlockRef(block.block_hash, parent, tuple(tokens)), staging)
        if job is not None:
            store.wait([job])
            jobs.append(job)
        parent = block.block_hash
    return len(jobs)


def ttft(llm: LLM, prompt: list[int], cost: CostModel) -> tuple[float, dict]:
    llm.reset_prefix_cache()
    llm.scheduler.policy = dataclasses.replace(llm.scheduler.policy, cost=cost)
    before = llm.stats()
    out = llm.generate(prompt, FIRST_TOKEN, use_tqdm=False)[0]
    after = llm.stats()
    keys = ("nvme_loaded_blocks", "nvme_failed_loads", "nvme_corrupt", "nvme_io_errors", "prefill_tokens")
    moved = {k: after[k] - before[k] for k in keys}
    return out.metrics.ttft, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/tieredkv-nvme", help="NVMe store directory (emptied first)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    require_cuda()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    peaks = pinned_peaks()
    disk = measure_disk_read(args.dir, 1 << 30)
    report("disk O_DIRECT sequential read, 4 MiB chunks", disk / 1e9, "GB/s")
    report("pinned H2D peak", peaks["h2d_peak_gbs"], "GB/s")
    llm = LLM(model="llama-3-8b", device="cuda", dtype="bfloat16", num_gpu_blocks=5000,
              cpu_cache_bytes="10GiB", nvme_path=args.dir, nvme_bytes="48GiB", io_backend="uring",
              max_num_batched_tokens=16384, preemption="recompute")
    runner = llm.runner
    t1 = _timed(lambda: runner.prefill_probe(2048))
    t2 = _timed(lambda: runner.prefill_probe(8192))
    d2h, h2d = measure_bandwidth(runner.device)
    calibrated = CostModel(d2h, h2d, *fit_prefill(2048, t1, 8192, t2), disk_read_bytes_per_s=disk)
    print(f"calibrated cost model: {calibrated}")
    # the fixed policies, as cost models under which the split puts every block on one side
    load_only = dataclasses.replace(calibrated, prefill_s_per_token=1e3)
    recompute_only = dataclasses.replace(calibrated, disk_read_bytes_per_s=1e-3)
    rng = random.Random(0)
    records = []
    for length in LENGTHS:
        prefix = [rng.randrange(1000, 120000) for _ in range(length)]
        llm.generate(prefix + [5] * QUESTION, FIRST_TOKEN, use_tqdm=False)  # computes the prefix KV
        written = spill_prompt_blocks(llm, prefix + [5] * QUESTION)
        print(f"{length} prefix: {written} blocks written to NVMe; store {llm.kv.offload.nvme.store.stats()}")
        prompt = prefix + [rng.randrange(1000, 120000) for _ in range(QUESTION)]
        row = {"prefix_tokens": length, "blocks_on_nvme": written}
        for name, cost in (("load-only", load_only), ("recompute-only", recompute_only),
                           ("load-and-recompute", calibrated)):
            seconds, moved = ttft(llm, prompt, cost)
            row[name] = seconds
            report(f"{length} prefix: TTFT {name}", seconds * 1e3, "ms")
            print(f"    {moved}", flush=True)
        best_fixed = min(row["load-only"], row["recompute-only"])
        row["speedup_over_better"] = best_fixed / row["load-and-recompute"]
        print(f"{length} prefix: load-and-recompute is {row['speedup_over_better']:.2f}x the better of the "
              f"other two ({'PASS' if row['speedup_over_better'] > 1 else 'FAIL'})", flush=True)
        records.append(row)
    llm.close()
    write_json(args.json, records)


def _timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
