"""End to end on the GPU: the `llama-3-8b` preset (random bf16 weights), 64 requests of 2,048
prompt tokens and 256 new tokens, through tieredkv and through transformers `generate` on the
same weights, in one run. Also a decode step against its memory floor: (weight bytes + the K/V
bytes the batch reads) / the device copy bandwidth measured in the same run.

    python benchmarks/bench_decode.py [--requests 64] [--prompt 2048] [--new 256] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import hbm_copy_peak, report, require_cuda, time_cuda, write_json
from decode_step import DecodeStep

from tieredkv import LLM, SamplingParams
from tieredkv.model.presets import build_preset


def run_tieredkv(prompts: list[list[int]], new_tokens: int) -> tuple[float, LLM]:
    llm = LLM(model="llama-3-8b", device="cuda", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=16384, gpu_memory_utilization=0.5)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # warm-up with other prompts of the same shapes (a serving engine is warm): compiles and
    # tunes the kernels for the chunk sizes this workload produces
    warm = [[t + 1 for t in p] for p in prompts]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    # every request's first token marks the end of the prefill phase
    first_tokens = max(o.metrics.first_token_time for o in outs) - min(o.metrics.arrival_time for o in outs)
    report("  prefill phase (until every request has its first token)", first_tokens, "s")
    report("  decode phase (the rest)", elapsed - first_tokens, "s")
    return elapsed, llm


def run_transformers(prompts: list[list[int]], new_tokens: int) -> float:
    model = build_preset("llama-3-8b", seed=0, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    model.generate(ids[:2, :64], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                                    "attention_mask": torch.ones_like(ids[:2, :64])})
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    require_cuda()
    copy_peak = hbm_copy_peak()
    report("HBM device-to-device copy", copy_peak, "GB/s")
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 120000) for _ in range(args.prompt)] for _ in range(args.requests)]
    out_tokens = args.requests * args.new
    records = []
    ours, llm = run_tieredkv(prompts, args.new)
    records.append(report(f"tieredkv end to end ({args.requests} x {args.prompt} in, {args.new} out)", ours, "s"))
    report("tieredkv output tokens/s", out_tokens / ours, "tok/s")
    step = DecodeStep(batch=args.requests, context=args.prompt, runner=llm.runner)
    step_s = time_cuda(step, reps=10)
    floor_s = step.bytes_read / (copy_peak * 1e9)
    records.append(report(f"decode step, batch {args.requests}, context {args.prompt}", step_s * 1e3, "ms"))
    records.append(report("decode step memory floor (weights + KV read at copy bandwidth)", floor_s * 1e3, "ms"))
    print(f"decode step / floor: {step_s / floor_s:.2f}x (target <= 1.5x)")
    del llm, step
    torch.cuda.empty_cache()
    if not args.skip_hf:
        theirs = run_transformers(prompts, args.new)
        records.append(report("transformers generate, same workload", theirs, "s"))
        report("transformers output tokens/s", out_tokens / theirs, "tok/s")
        print(f"speed-up over transformers generate: {theirs / ours:.2f}x (target >= 3x)")
    write_json(args.json, records)


if __name__ == "__main__":
    main()
