"""Tensor parallelism on two GPUs, in one run:

- `llama-3-8b` (random bf16 weights), TP=2 (`all_reduce: nccl`) against TP=1: a decode step
  (batch 64, context 2k) and a prefill step (4 x 2k tokens), each timed as the engine runs it
  (inputs sent to the ranks, forward pass, rank 0 samples); each against its memory floor (a
  rank's weights and KV read at the HBM copy bandwidth measured in the same run). The
  collectives' share, each step run as serving runs it (a decode step in a CUDA graph, a
  prefill step eagerly): the GPU time of its kernels beside its wall time, the GPU time of its
  NCCL kernels (profiler on the ranks), and the step's all-reduces (2 per layer) timed alone
  the same way on the same activations: in-step / alone is the target (>= 80%); NCCL's bus
  bandwidth on 1 GiB beside them.
- The same TP=2 engine with `all_reduce: auto`: its decode and prefill steps against the NCCL
  engine's, and a decode step's all-reduces through the one-shot path in symmetric memory, alone
  (eager) and in one CUDA graph, against NCCL's same figures.
- Swap bandwidth at TP=2: a swap-out and a swap-in of `--swap-gib` of KV through the engine's
  transfers (both ranks copy their heads of the same blocks at once, each over its own link),
  against the sum of the two GPUs' pinned-copy peaks, each measured alone in the same run
  (target >= 90%).

    python benchmarks/bench_tp.py [--model llama-3-8b] [--batch 64] [--context 2048]
                                  [--prefill-seqs 4] [--swap-gib 4] [--json results.json]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from common import GiB, hbm_copy_peak, report, require_cuda, time_cuda, write_json

from tieredkv import LLM, SamplingParams
from tieredkv.decode import Decoder
from tieredkv.model.runner import KVSpec, StepInputs, load_hf_config
from tieredkv.parallel.plan import Draw, NewRequest, StepPlan
from tieredkv.sequence import ScheduledSeq, Sequence
from tieredkv.transfer.engine import TransferJob

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def make_step(batch: int, context: int, new: int, first_block: int = 0, vocab: int = 30000):
    """`batch` sequences of `context` cached tokens computing `new` more each (decode: 1,
    prefill: context 0); their block tables over scattered blocks from `first_block` on."""
    per_seq = -(-(context + new) // BLOCK_SIZE)
    rng = random.Random(0)
    blocks = list(range(first_block, first_block + batch * per_seq))
    rng.shuffle(blocks)
    scheduled, tables = [], []
    for b in range(batch):
        seq = Sequence(f"bench-{b}", [rng.randrange(vocab // 2, vocab) for _ in range(context + new)], GREEDY)
        seq.num_computed_tokens = context
        scheduled.append(ScheduledSeq(seq, new))
        tables.append(blocks[b * per_seq : (b + 1) * per_seq])
    return scheduled, tables, batch * per_seq


def wall_time(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
    """Median host seconds of `fn` (each call returns once its tokens are sampled)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a forward pass reads of the weights (the embedding: one row per token, none)."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)


# ---------------------------------------------------------------------- on the ranks


def rank_weight_bytes(worker) -> int:
    return weight_bytes(worker.runner.model)


def rank_kernel_times(worker, plan: StepPlan, reps: int, graphed: bool) -> tuple[float, float]:
    """(NCCL kernels, all kernels): GPU seconds per step of `plan` on this rank, its decode
    batches run as a CUDA graph (`graphed`, as serving runs them) or eagerly."""
    graphs = worker.runner.graphs
    if not graphed:
        worker.runner.graphs = None
    try:
        worker.step(plan)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                worker.step(plan)
            torch.cuda.synchronize()
    finally:
        worker.runner.graphs = graphs
    events = prof.key_averages()
    nccl_us = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
    all_us = sum(e.self_device_time_total for e in events)
    return nccl_us / 1e6 / reps, all_us / 1e6 / reps


def rank_all_reduce_time(worker, tokens: int, reps: int, one_shot: bool = False) -> float:
    """Seconds of one all-reduce of `tokens` hidden states (bf16), alone: NCCL's, or the
    engine's one-shot path."""
    x = hidden_states(worker, tokens)
    fn = summer(worker, x, one_shot)
    return time_cuda(lambda: fn(x), reps=reps, warmup=3)


def rank_graphed_all_reduces(worker, tokens: int, count: int, one_shot: bool = False) -> float:
    """Seconds of one all-reduce of `tokens` hidden states (bf16) when `count` of them run back
    to back in one CUDA graph, as a graphed decode step runs them (no launch per call): NCCL's,
    or the engine's one-shot path."""
    x = hidden_states(worker, tokens)
    fn = summer(worker, x, one_shot)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # NCCL's first call on a stream sets up outside the capture
        fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            fn(x)
    return time_cuda(graph.replay, reps=10, warmup=2) / count


def hidden_states(worker, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, worker.runner.hf_config.hidden_size, dtype=torch.bfloat16, device="cuda")


def summer(worker, x: torch.Tensor, one_shot: bool) -> Callable[[torch.Tensor], object]:
    """`dist.all_reduce` (in place), or the engine's one-shot path (a new tensor) if it takes `x`."""
    if not one_shot:
        return dist.all_reduce
    why = rank_one_shot_refusal(worker, x.shape[0])
    if why:
        raise ValueError(f"the one-shot path does not take {tuple(x.shape)}: {why}")
    return worker.all_reduce.one_shot


def rank_one_shot_refusal(worker, tokens: int) -> str | None:
    """Why this rank's engine does not sum `tokens` hidden states one-shot, or None."""
    path = worker.all_reduce.one_shot
    if path is None:
        return worker.all_reduce.description
    if not path.takes(hidden_states(worker, tokens)):
        return f"{tokens} tokens of hidden states exceed its buffer of {path.buffer.numel()} bytes"
    return None


def rank_bus_bandwidth(worker, num_bytes: int) -> float:
    """NCCL's own all-reduce bus bandwidth (GB/s) for `num_bytes` of bf16, as nccl-tests counts
    it: 2 (n - 1) / n of the bytes per second."""
    x = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    world = dist.get_world_size()
    return 2 * (world - 1) / world * num_bytes / time_cuda(lambda: dist.all_reduce(x), reps=10, warmup=3) / 1e9


def rank_pinned_peaks(worker, rank: int | None) -> tuple[float, float] | None:
    """(D2H, H2D) GB/s of a 1 GiB pinned copy on this rank, if it is `rank` (None: every rank
    at once)."""
    if rank is not None and worker.rank != rank:
        dist.barrier()
        return None
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    d2h = GiB / time_cuda(lambda: host.copy_(dev, non_blocking=True), reps=5) / 1e9
    h2d = GiB / time_cuda(lambda: dev.copy_(host, non_blocking=True), reps=5) / 1e9
    dist.barrier()
    return d2h, h2d


# ---------------------------------------------------------------------- TP=1 and TP=2


def engine(model: str, tp: int, num_blocks: int, batch: int, cpu_bytes: int = 0, all_reduce: str = "nccl") -> LLM:
    extra = {"cpu_cache_bytes": cpu_bytes, "preemption": "swap"} if cpu_bytes else {}
    return LLM(model=model, device="cuda", dtype="bfloat16", tensor_parallel_size=tp, num_gpu_blocks=num_blocks,
               block_size=BLOCK_SIZE, max_num_seqs=batch, all_reduce=all_reduce, **extra)


def tp1_steps(llm: LLM, decode, prefill) -> tuple[float, float]:
    """(decode step, prefill step) seconds: forward pass and greedy sampling, one process."""
    runner, sampler = llm.runner, llm.decoder.sampler

    def run(step):
        scheduled, tables, _ = step
        logits = runner.execute(scheduled, tables)
        return sampler.sample(logits, [GREEDY] * len(logits), [None] * len(logits))

    return wall_time(lambda: run(decode)), wall_time(lambda: run(prefill), reps=5)


def run_tp1(model: str, num_blocks: int, batch: int, decode, prefill, kv_read: int, hbm: float):
    """((decode step, prefill step) seconds, decode memory floor) of one process on GPU 0."""
    with engine(model, 1, num_blocks, batch) as llm:
        steps = tp1_steps(llm, decode, prefill)
        floor = (weight_bytes(llm.runner.model) + kv_read * llm.runner.kv_spec.block_bytes(1)) / (hbm * 1e9)
    return steps, floor


def tp2_steps(llm: LLM, decode, prefill) -> tuple[float, float]:
    workers = llm.runner

    def run(step):
        scheduled, tables, _ = step
        seqs = [s.seq for s in scheduled]
        return workers.execute(scheduled, tables, seqs, Decoder.draws(seqs))

    return wall_time(lambda: run(decode)), wall_time(lambda: run(prefill), reps=5)


def plan_of(llm: LLM, step) -> StepPlan:
    scheduled, tables, _ = step
    ids = tuple(s.seq.request_id for s in scheduled)
    return StepPlan(inputs=StepInputs.build(scheduled, tables, BLOCK_SIZE), draws=tuple(Draw(i, (0,)) for i in ids),
                    new_requests=tuple(NewRequest(i, GREEDY, (None,)) for i in ids))


def collectives(llm: LLM, decode, prefill, args, records: list, steps: dict) -> dict[str, float]:
    """Per step, as serving runs it (a decode step in a CUDA graph, a prefill step eagerly): the
    GPU time of its kernels beside its wall time, the GPU time of its NCCL kernels, and the same
    all-reduces timed alone the same way (NCCL's own time at that size: in-step efficiency is
    alone / in-step); NCCL's bus bandwidth on a 1 GiB all-reduce beside them. Returns one decode
    all-reduce's seconds alone, eager (`alone`) and in a CUDA graph of a step's all-reduces
    (`graphed`)."""
    ranks = llm.runner.ranks
    count = 2 * llm.runner.hf_config.num_hidden_layers  # all-reduces per step
    hidden = llm.runner.hf_config.hidden_size
    bus_factor = 2 * (ranks.world - 1) / ranks.world
    peak = min(ranks.call("apply", rank_bus_bandwidth, GiB))
    records.append(report("NCCL all-reduce bus bandwidth, 1 GiB", peak, "GB/s"))
    decode_eager = max(ranks.call("apply", rank_all_reduce_time, args.batch, 10))
    figures = {"alone": decode_eager}
    for name, step, tokens, graphed in (("decode", decode, args.batch, True),
                                        ("prefill", prefill, args.prefill_seqs * args.context, False)):
        how = "one CUDA graph" if graphed else "eager"
        per_rank = ranks.call("apply", rank_kernel_times, plan_of(llm, step), 5, graphed)
        nccl, busy = max(n for n, _ in per_rank), max(b for _, b in per_rank)
        if graphed:
            alone = figures["graphed"] = max(ranks.call("apply", rank_graphed_all_reduces, tokens, count))
        else:
            alone = max(ranks.call("apply", rank_all_reduce_time, tokens, 10))
        records.append(report(f"TP=2 {name} step ({how}): GPU kernel time", busy * 1e3, "ms",
                              steps[name] * 1e3, f"{name} step, wall"))
        records.append(report(f"TP=2 {name} step ({how}): NCCL kernel time", nccl * 1e3, "ms",
                              busy * 1e3, "GPU kernel time"))
        records.append(report(f"TP=2 {name}: {count} all-reduces of {tokens} tokens alone ({how})",
                              count * alone * 1e3, "ms", nccl * 1e3, "in-step NCCL time"))
        message = tokens * hidden * 2
        own = bus_factor * message / alone / 1e9
        records.append(report(f"NCCL all-reduce bus bandwidth, {name} message ({message / 2**20:.2f} MiB), "
                              f"alone ({how})", own, "GB/s", peak, "NCCL, 1 GiB"))
        if nccl == 0:
            print(f"  the profiler saw no NCCL kernel in the {name} step")
            continue
        in_step = bus_factor * count * message / nccl / 1e9
        records.append(report(f"TP=2 {name} step: all-reduce bus bandwidth in the step", in_step, "GB/s",
                              own, "NCCL alone, same size"))
        print(f"  in the step / NCCL alone at the same size: {in_step / own:.1%} (target >= 80%)")
    return figures


@dataclass(frozen=True)
class NCCLFigures:
    """What the `all_reduce: nccl` engine measured, for the `auto` one to be read against."""

    decode_s: float  # a decode step
    prefill_s: float  # a prefill step
    alone_s: float  # one decode all-reduce, alone (eager)
    graphed_s: float  # one decode all-reduce of a CUDA graph of a step's all-reduces
    decode_floor_s: float  # a decode step's memory floor per rank


def one_shot(model: str, num_blocks: int, decode, prefill, args, records: list, nccl: NCCLFigures) -> None:
    """A TP=2 engine with `all_reduce: auto`: its steps beside the NCCL engine's, and a decode
    step's all-reduces through the one-shot path, alone and in one CUDA graph, against NCCL's."""
    with engine(model, 2, num_blocks, args.batch, all_reduce="auto") as llm:
        ranks = llm.runner.ranks
        refusals = [why for why in ranks.call("apply", rank_one_shot_refusal, args.batch) if why]
        if refusals:
            print(f"  one-shot path not taken at the decode step: {refusals[0]}")
        decode_s, prefill_s = tp2_steps(llm, decode, prefill)
        records.append(report(f"TP=2 decode step, all_reduce auto, batch {args.batch}", decode_s * 1e3, "ms",
                              nccl.decode_floor_s * 1e3, "memory floor per rank"))
        print(f"  speed-up over all_reduce nccl (decode step): {nccl.decode_s / decode_s:.2f}x")
        tokens = args.prefill_seqs * args.context
        records.append(report(f"TP=2 prefill, all_reduce auto, {args.prefill_seqs} x {args.context} tokens",
                              tokens / prefill_s, "tok/s", tokens / nccl.prefill_s, "all_reduce nccl"))
        if refusals:
            return
        count = 2 * llm.runner.hf_config.num_hidden_layers
        alone = max(ranks.call("apply", rank_all_reduce_time, args.batch, 10, True))
        records.append(report(f"TP=2 decode: {count} all-reduces of {args.batch} tokens, one-shot, alone",
                              count * alone * 1e3, "ms", count * nccl.alone_s * 1e3, "NCCL, alone"))
        graphed = max(ranks.call("apply", rank_graphed_all_reduces, args.batch, count, True))
        records.append(report(f"TP=2 decode: {count} all-reduces of {args.batch} tokens, one-shot, one CUDA graph",
                              count * graphed * 1e3, "ms", count * nccl.graphed_s * 1e3, "NCCL, one CUDA graph"))


def swap_bandwidth(llm: LLM, swap_bytes: int, records: list) -> None:
    ranks, transfers = llm.runner.ranks, llm.kv.offload.transfers
    peaks = [ranks.call("apply", rank_pinned_peaks, rank)[rank] for rank in range(ranks.world)]
    together = ranks.call("apply", rank_pinned_peaks, None)
    for rank, (d2h, h2d) in enumerate(peaks):
        report(f"rank {rank} pinned copy peak D2H (alone)", d2h, "GB/s")
        report(f"rank {rank} pinned copy peak H2D (alone)", h2d, "GB/s")
    report("both ranks' pinned copies at once, D2H sum", sum(d for d, _ in together), "GB/s")
    report("both ranks' pinned copies at once, H2D sum", sum(h for _, h in together), "GB/s")
    num_blocks = min(swap_bytes // transfers.block_bytes, llm.kv.num_blocks, llm.kv.offload.tier.num_blocks)
    gpu_ids = list(range(num_blocks))
    random.Random(1).shuffle(gpu_ids)  # a swapped sequence's blocks lie anywhere in the GPU tier
    cpu_ids = list(range(num_blocks))
    nbytes = num_blocks * transfers.block_bytes
    for kind, peak in (("d2h", sum(d for d, _ in peaks)), ("h2d", sum(h for _, h in peaks))):
        def move(kind=kind):
            transfers.wait([transfers.submit(TransferJob(kind, tuple(gpu_ids), tuple(cpu_ids)))])

        gbs = nbytes / wall_time(move, reps=5, warmup=1) / 1e9
        name = f"TP=2 swap {kind.upper()} of {nbytes / GiB:.1f} GiB (both ranks)"
        records.append(report(name, gbs, "GB/s", peak, "sum of the ranks' pinned peaks"))
        print(f"  aggregate / sum of peaks: {gbs / peak:.1%} (target >= 90%)")
    transfers.poll()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill-seqs", type=int, default=4, help="prefill step: this many prompts of --context")
    parser.add_argument("--swap-gib", type=float, default=4.0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    require_cuda()
    if torch.cuda.device_count() < 2:
        raise SystemExit("this benchmark needs two GPUs")
    records: list[dict] = []
    hbm = hbm_copy_peak()
    report("HBM device-to-device copy (GPU 0)", hbm, "GB/s")
    decode = make_step(args.batch, args.context, 1)
    prefill = make_step(args.prefill_seqs, 0, args.context, first_block=decode[2])
    num_blocks = decode[2] + prefill[2]
    kv_read = args.batch * (args.context + 1)  # tokens of KV a decode step reads

    one, floor1 = run_tp1(args.model, num_blocks, args.batch, decode, prefill, kv_read, hbm)
    gc.collect()  # the TP=1 model leaves GPU 0 to rank 0
    torch.cuda.empty_cache()
    swap_bytes = int(args.swap_gib * GiB)  # KV moved by each swap, both ranks together
    block_bytes = KVSpec.of(load_hf_config(args.model), "bfloat16").block_bytes(BLOCK_SIZE)
    swap_blocks = swap_bytes // block_bytes
    with engine(args.model, 2, max(num_blocks, swap_blocks), args.batch, cpu_bytes=swap_bytes + GiB,
                all_reduce="nccl") as llm:
        two = tp2_steps(llm, decode, prefill)
        rank_kv = llm.runner.rank_kv_spec.block_bytes(1)
        floor2 = (max(llm.runner.ranks.call("apply", rank_weight_bytes)) + kv_read * rank_kv) / (hbm * 1e9)
        records.append(report(f"TP=1 decode step, batch {args.batch}, context {args.context}", one[0] * 1e3, "ms",
                              floor1 * 1e3, "memory floor"))
        records.append(report(f"TP=2 decode step, batch {args.batch}, context {args.context}", two[0] * 1e3, "ms",
                              floor2 * 1e3, "memory floor per rank"))
        print(f"  TP=2 speed-up over TP=1 (decode step): {one[0] / two[0]:.2f}x")
        tokens = args.prefill_seqs * args.context
        records.append(report(f"TP=1 prefill, {args.prefill_seqs} x {args.context} tokens", tokens / one[1], "tok/s"))
        records.append(report(f"TP=2 prefill, {args.prefill_seqs} x {args.context} tokens", tokens / two[1], "tok/s",
                              2 * tokens / one[1], "twice TP=1"))
        print(f"  TP=2 speed-up over TP=1 (prefill): {one[1] / two[1]:.2f}x")
        all_reduce_s = collectives(llm, decode, prefill, args, records, {"decode": two[0], "prefill": two[1]})
        swap_bandwidth(llm, swap_bytes, records)
    nccl = NCCLFigures(two[0], two[1], all_reduce_s["alone"], all_reduce_s["graphed"], floor2)
    one_shot(args.model, num_blocks, decode, prefill, args, records, nccl)
    write_json(args.json, records)


if __name__ == "__main__":
    main()
