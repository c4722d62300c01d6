"""n samples of one long prompt, two ways, on the `llama-3-8b` preset (random bf16 weights): one
request that forks into its samples (`SamplingParams(n=8)`: the prompt is computed once, its
blocks shared, the partly filled last one copied on write) against n independent requests that
share the prompt through prefix caching (vLLM v1's way). Each way runs at the same GPU budget,
twice: with room for everything (the KV bytes each way holds) and under memory pressure (a budget
below what the samples need, so sequences are preempted: the throughput each way gets). The
floor of the KV bytes is the prompt once plus every sample's own blocks; the ratios are printed.

    python benchmarks/bench_parallel_sampling.py [--n 8] [--prompt 4096] [--new 256] [--repeats 3]
        [--pressure 0.5] [--max-num-batched-tokens 8192] [--json out.json]
    python benchmarks/bench_parallel_sampling.py --model tiny-llama --device cpu --prompt 512 --new 32
        (a smoke test of the same steps on a CPU)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass

import torch
from common import report, require_cuda, write_json

from tieredkv import LLM, SamplingParams

BLOCK_SIZE = 16


@dataclass
class Run:
    """One way of drawing the samples, once."""

    seconds: float
    peak_blocks: int
    mean_blocks: float
    prefill_tokens: int
    preemptions: int
    samples: list[list[int]]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def draw(llm: LLM, prompt: list[int], n: int, new: int, seed: int, fork: bool) -> Run:
    """Draw n samples of `prompt` (one forking request, or n requests) and measure them."""
    llm.reset_prefix_cache()  # nothing cached from an earlier run
    before = llm.stats()
    common = dict(max_tokens=new, temperature=1.0, ignore_eos=True)
    sync()
    start = time.perf_counter()
    if fork:
        ids = [llm.add_request(prompt, SamplingParams(n=n, seed=seed, **common))]
    else:  # request i draws from seed + i, as sample i of the forking request does
        ids = [llm.add_request(prompt, SamplingParams(seed=seed + i, **common)) for i in range(n)]
    finished, used = {}, []
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
        used.append(llm.stats()["gpu_blocks_used"])
    sync()
    seconds = time.perf_counter() - start
    after = llm.stats()
    samples = [c.token_ids for rid in ids for c in finished[rid].outputs]
    assert len(samples) == n and all(len(s) == new for s in samples)
    preempted = sum(after["preemptions"].values()) - sum(before["preemptions"].values())
    return Run(seconds, max(used), statistics.fmean(used), after["prefill_tokens"] - before["prefill_tokens"],
               preempted, samples)


def compare(llm: LLM, args: argparse.Namespace, label: str) -> list[dict]:
    """Both ways, `args.repeats` times each (alternating, each on a prompt of its own), medians."""
    rng = random.Random(0)
    runs: dict[bool, list[Run]] = {True: [], False: []}
    for repeat in range(args.repeats + 1):  # the first round warms up (kernels, graphs)
        prompt = [rng.randrange(3, llm.runner.model.config.vocab_size) for _ in range(args.prompt)]
        for fork in (True, False):
            run = draw(llm, prompt, args.n, args.new if repeat else 4, seed=1000 * repeat, fork=fork)
            if repeat:
                runs[fork].append(run)
    mib = llm.block_bytes / 2**20
    floor = (-(-args.prompt // BLOCK_SIZE) + args.n * -(-args.new // BLOCK_SIZE)) * mib
    records = []
    for fork, name in ((True, f"one request, n={args.n}"), (False, f"{args.n} requests, prefix caching")):
        rs = runs[fork]
        throughput = args.n * args.new / _median(rs, "seconds")
        records.append(report(f"[{label}] {name}: output tokens/s", throughput, "tok/s"))
        records.append(report(f"[{label}] {name}: peak GPU KV", _median(rs, "peak_blocks") * mib, "MiB",
                              floor, "prompt once + own blocks"))
        report(f"[{label}] {name}: mean GPU KV", _median(rs, "mean_blocks") * mib, "MiB")
        report(f"[{label}] {name}: prefill tokens computed", _median(rs, "prefill_tokens"), "tok")
        report(f"[{label}] {name}: preemptions", _median(rs, "preemptions"), "")
    speedup = _median(runs[False], "seconds") / _median(runs[True], "seconds")
    saving = _median(runs[False], "peak_blocks") / _median(runs[True], "peak_blocks")
    same = sum(a == b for f, i in zip(runs[True], runs[False], strict=True)
               for a, b in zip(f.samples, i.samples, strict=True))
    print(f"[{label}] throughput, forking / independent: {speedup:.2f}x (target >= 1.5x under pressure)")
    print(f"[{label}] peak GPU KV, independent / forking: {saving:.2f}x")
    print(f"[{label}] samples equal both ways (same seeds): {same} of {args.n * args.repeats}")
    for name, value in (("throughput ratio", speedup), ("peak KV ratio", saving)):
        records.append({"name": f"[{label}] {name}", "value": value, "unit": "x", "peak": None, "peak_name": ""})
    return records


def _median(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def engine(num_gpu_blocks: int, args: argparse.Namespace) -> LLM:
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    return LLM(model=args.model, device=args.device, dtype=dtype, block_size=BLOCK_SIZE,
               num_gpu_blocks=num_gpu_blocks, max_num_seqs=max(args.n, 8),
               max_num_batched_tokens=args.max_num_batched_tokens, preemption="recompute")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pressure", type=float, default=0.5,
                        help="the pressured budget: the prompt's blocks + this share of the samples' own blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--device", default="cuda", help="cpu runs the same steps (a smoke test, with tiny-llama)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.device == "cuda":
        require_cuda()
    prompt_blocks = -(-args.prompt // BLOCK_SIZE)
    own_blocks = args.n * (-(-args.new // BLOCK_SIZE) + 1)
    budgets = {"room": 2 * (args.n * prompt_blocks + own_blocks),
               "pressure": prompt_blocks + int(args.pressure * own_blocks)}
    records = []
    for label, blocks in budgets.items():
        llm = engine(blocks, args)
        report(f"[{label}] GPU KV budget", blocks * llm.block_bytes / 2**20, "MiB")
        records += compare(llm, args, label)
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_json(args.json, records)


if __name__ == "__main__":
    main()
