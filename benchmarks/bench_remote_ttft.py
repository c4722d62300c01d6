"""Two engines sharing a Redis server: time to first token of a long prefix that another engine
process computed, served from the server, against recomputing it.

It starts its own `redis-server` on a free loopback port, unless `--url` names one. For each
prefix length, on the `llama-3-8b` preset (random bf16 weights, the same in both processes):
1. a first engine process prefills prefix + a 64-token question and writes the prompt's full
   blocks to the server through its remote store (as an engine that demoted them would have);
2. a second engine process (this one, started fresh) serves prefix + another question three ways:
   - load-only: every prefix block read from the server (server -> CPU -> GPU);
   - recompute-only: the prefix prefilled again;
   - load-and-recompute: the first blocks computed while the later ones are read, split by the
     cost model calibrated in this run (PCIe, prefill time, the server's read bandwidth).
Printed: each TTFT, the server's block read bandwidth and the pinned H2D peak of the same run,
the load-only TTFT over the prefix's bytes at that bandwidth, and the speedup of the better of
the two ways that use the server over recomputing.

    python benchmarks/bench_remote_ttft.py --lengths 16384 32768 [--json out.json]
    python benchmarks/bench_remote_ttft.py --model tiny-llama --device cpu --dtype float32 \
        --cpu-cache-bytes 64MiB --lengths 512   # a dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import time

import torch
from common import FIRST_TOKEN, first_token_time, pinned_peaks, report, require_cuda, start_redis_server, write_json

from tieredkv import LLM
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.calibrate import fit_prefill, measure_bandwidth
from tieredkv.policy import CostModel
from tieredkv.tiers.backend import BlockRef

QUESTION = 64
ENGINE = dict(num_gpu_blocks=5000, max_num_batched_tokens=16384, preemption="recompute")
WRITE_BATCH = 64  # blocks staged in host memory at once by the first engine


def prefixes(lengths: list[int], vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def write_prompt_blocks(llm: LLM, prompt: list[int]) -> int:
    """Write the prompt's full blocks, cached on the GPU, to the server; how many were stored."""
    kv, store = llm.kv, llm.remote
    shape, dtype = kv.offload.tier.data[0].shape, kv.offload.tier.data.dtype
    staging = torch.empty((WRITE_BATCH, *shape), dtype=dtype, pin_memory=torch.cuda.is_available())
    hashes = extend_block_hashes([], prompt, kv.block_size, kv.root_hash)
    refs, parent = [], kv.root_hash
    for i, block_hash in enumerate(hashes):
        tokens = tuple(prompt[i * kv.block_size : (i + 1) * kv.block_size])
        refs.append(BlockRef(block_hash, parent, tokens))
        parent = block_hash
    stored = 0
    for start in range(0, len(refs), WRITE_BATCH):
        jobs = []
        for slot, ref in enumerate(refs[start : start + WRITE_BATCH]):
            block = kv.pool.lookup(ref.block_hash, ref.parent_hash, list(ref.token_ids))
            assert block is not None, "the prompt's blocks must still be cached on the GPU"
            staging[slot].copy_(llm.runner.kv_cache[:, :, block.block_id])
            jobs.append(store.submit_write(ref, staging[slot]))
        started = [j for j in jobs if j is not None]
        stored += sum(store.wait(started).values())
    return stored


def engine(args: argparse.Namespace, url: str) -> LLM:
    return LLM(model=args.model, device=args.device, dtype=args.dtype, cpu_cache_bytes=args.cpu_cache_bytes, **ENGINE,
               remote_url=url)


def first_engine(args: argparse.Namespace, url: str, lengths: list[int]) -> None:
    """Process 1: compute each prefix and leave its blocks on the server."""
    with engine(args, url) as llm:
        for prefix in prefixes(lengths, llm.runner.model.config.vocab_size):
            prompt = prefix + [5] * QUESTION
            llm.generate(prompt, FIRST_TOKEN, use_tqdm=False)
            print(json.dumps({"prefix_tokens": len(prefix), "blocks_stored": write_prompt_blocks(llm, prompt)}),
                  flush=True)
            llm.reset_prefix_cache()


MOVED = ("remote_hit_blocks", "remote_errors", "nvme_loaded_blocks", "prefill_tokens")


def second_engine(args: argparse.Namespace, url: str, lengths: list[int]) -> list[dict]:
    """Process 2: serve each prefix with another question, three ways."""
    if args.device == "cuda":
        report("pinned H2D peak", pinned_peaks()["h2d_peak_gbs"], "GB/s")
    llm = engine(args, url)
    runner = llm.runner
    n1, n2 = min(2048, lengths[0] // 4), min(8192, lengths[0])
    t1, t2 = _timed(lambda: runner.prefill_probe(n1)), _timed(lambda: runner.prefill_probe(n2))
    d2h, h2d = measure_bandwidth(runner.device)
    server = llm.remote.measure_read_bandwidth(1 << 30, max_blocks=1024)
    report("server block reads through the tier", server / 1e9, "GB/s")
    calibrated = CostModel(d2h, h2d, *fit_prefill(n1, t1, n2, t2), disk_read_bytes_per_s=server)
    print(f"calibrated cost model: {calibrated}")
    load_only = dataclasses.replace(calibrated, prefill_s_per_token=1e3)
    recompute_only = dataclasses.replace(calibrated, disk_read_bytes_per_s=1e-3)
    rng = random.Random(1)
    records = []
    vocab_size = llm.runner.model.config.vocab_size
    for prefix in prefixes(lengths, vocab_size):
        prompt = prefix + [rng.randrange(3, vocab_size) for _ in range(QUESTION)]
        row: dict = {"prefix_tokens": len(prefix)}
        for name, cost in (("load-only", load_only), ("recompute-only", recompute_only),
                           ("load-and-recompute", calibrated)):
            row[name], moved = first_token_time(llm, prompt, cost, MOVED)
            report(f"{len(prefix)} prefix: TTFT {name}", row[name] * 1e3, "ms")
            print(f"    {moved}", flush=True)
        # the bound a load-only TTFT is judged against: the prefix's bytes at the rate measured above
        at_rate = len(prefix) // llm.config.cache.block_size * llm.block_bytes / server
        row["load_only_over_bytes_at_rate"] = row["load-only"] / at_rate
        print(f"{len(prefix)} prefix: load-only {row['load_only_over_bytes_at_rate']:.2f}x its bytes at "
              f"{server / 1e9:.2f} GB/s ({at_rate * 1e3:.1f} ms)", flush=True)
        row["speedup_over_recompute"] = row["recompute-only"] / min(row["load-only"], row["load-and-recompute"])
        print(f"{len(prefix)} prefix: from the server {row['speedup_over_recompute']:.2f}x faster than "
              f"recomputing", flush=True)
        records.append(row)
    llm.close()
    return records


def _timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing server (default: start redis-server on a free port)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384], help="prefix lengths in tokens")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--device", default="cuda", help="cuda (the figures); cpu for a dry run of a tiny model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cpu-cache-bytes", default="10GiB", help="CPU tier (holds the prefix while it loads)")
    parser.add_argument("--first-engine", action="store_true", help=argparse.SUPPRESS)  # process 1
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.device == "cuda":
        require_cuda()
    if args.first_engine:
        return first_engine(args, args.url, args.lengths)
    proc, url = (None, args.url) if args.url else start_redis_server()
    try:
        cmd = [sys.executable, __file__, "--first-engine", "--url", url, "--lengths", *map(str, args.lengths),
               "--model", args.model, "--device", args.device, "--dtype", args.dtype,
               "--cpu-cache-bytes", args.cpu_cache_bytes]
        for line in subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines():
            print(f"first engine: {line}", flush=True)
        write_json(args.json, second_engine(args, url, args.lengths))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
