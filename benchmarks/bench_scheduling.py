"""TTFT-aware scheduling on the long-context workload: each variant of the config (by default
`configs/long_context_8b.yaml`: fcfs, the old scheduling, against ttft) serves the same requests
at the same arrival times; TTFT p50/p90/p99 and max (with the slowest request's prompt length),
ITL p50/p99, TPOT p90 and throughput, with ratios to the first variant.

Two clocks:
- `--sim` (CPU, no model): the real `Scheduler` and `KVCacheManager` (the config's GPU blocks
  and CPU tier, in blocks of `llama-3-8b`'s size, 2 MiB at 16 tokens, each holding a few bytes;
  a store below the CPU tier where the config has `nvme_path`: `SimDisk`, LRU, one block at a
  time each way at `SIM_DISK_BYTES_PER_S` or `--disk-gbps`, reads beside writes), each step
  taking the time `StepCost` gives it (its fixed part `--step-ms`, scaled by each of `--perturb`),
  a cost model pinned from H200 measurements of the `llama-3-8b` preset (see `H200_LLAMA_8B`).
  The loop waits for each step to end, unless `--host-us-per-token` gives its launch time (or
  `--launch-from` each variant's, as a device run measured it): then it waits only for steps
  that sample and schedules ahead of the GPU through the others, as the engine's loop does, as
  far as the GPU's queue of kernels lets it (`--launch-waits`).
  It shows what the policy does to the order of the work, and the scheduler's own host time
  (wall clock, not on the simulated one); the engine run says whether the cost model holds.
- without `--sim` (CUDA): `LLMEngine` with the config's model, wall clock, after a warm-up.

    python benchmarks/bench_scheduling.py --sim                       # CPU, ~1 min
    python benchmarks/bench_scheduling.py --sim --rates 1,1.5,2 --seeds 0,1,2 --requests 128
    python benchmarks/bench_scheduling.py --sim --vary prefill_aging=0.05,0.2   # a knob too
    python benchmarks/bench_scheduling.py --sim --trace conversation_trace.jsonl --fraction 0.014 --seeds 1 \
        --rates 0.6,0.8,1.0 --policies fcfs,ttft,hrrn --set scheduler.max_num_batched_tokens=8192 \
        --set cache.num_gpu_blocks=8192           # a Mooncake slice, full-length prompts (BENCHMARKS.md)
    python benchmarks/bench_scheduling.py --sim --bound               # and the least p99 any order could give
    python benchmarks/bench_scheduling.py configs/mooncake_conversation_8b.yaml --sim --rates 0.635 \
        --variants recompute-only,gpu+cpu16,gpu+cpu64   # a replay config, its CPU tiers (BENCHMARKS.md)
    python benchmarks/bench_scheduling.py configs/mooncake_synthetic_8b.yaml --sim --speed 8 \
        --variants gpu+cpu16,gpu+cpu16+nvme             # the store beside its CPU tier (SimDisk)
    python benchmarks/bench_scheduling.py configs/mooncake_conversation_8b.yaml --sim --step-ms 9 \
        --disk-gbps 1.8 --perturb 1,0.998,1.001 --variants gpu+cpu16,gpu+cpu16+nvme  # as the engine serves
    python benchmarks/bench_scheduling.py configs/long_docs_revisited_8b.yaml --sim --step-ms 9 --disk-gbps 1.3 \
        --variants gpu+cpu8GiB,gpu+cpu8GiB+nvme --json docs.json  # documents revisited (returning TTFT in the json)
    python benchmarks/bench_scheduling.py configs/long_docs_revisited_8b.yaml --sim --step-ms 9 --disk-gbps 1.36 \
        --host-us-per-token 11 --variants gpu+cpu8GiB,gpu+cpu8GiB+nvme   # the loop ahead of the GPU
    python benchmarks/bench_scheduling.py configs/long_docs_revisited_8b.yaml --sim --step-ms 9 --disk-gbps 1.56 \
        --host-us-per-token 1 --launch-waits 0.3 --variants gpu+cpu8GiB,gpu+cpu8GiB+nvme  # and a full kernel queue
    python benchmarks/bench_scheduling.py configs/multi_turn_8b.yaml --sim --step-ms 9 --disk-gbps 1.42 \
        --variants gpu+cpu8GiB,gpu+cpu8GiB+nvme --arrivals RUN/multi_turn_8b/gpu+cpu8GiB/result.json
                                                  # a closed-loop run's turns, replayed open-loop
    python benchmarks/bench_scheduling.py configs/multi_turn_8b.yaml --sim --step-ms 9 --disk-gbps 1.8 \
        --launch-waits 0.3 --variants gpu+cpu8GiB,gpu+cpu8GiB+nvme \
        --arrivals RUN/multi_turn_8b/gpu+cpu8GiB/result.json \
        --launch-from RUN/multi_turn_8b/*/result.json   # and each variant's loop as slow as it was there
    python benchmarks/bench_scheduling.py configs/mooncake_synthetic_8b.yaml --sim --speed 8 --step-ms 9 \
        --variants gpu+cpu16 --replay-policies   # the replacement policies on the stream the CPU tier serves
    python benchmarks/bench_scheduling.py                             # GPU (H200), the real engine
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from tieredkv.cache.manager import KVCacheManager
from tieredkv.cache.offload import CPUOffload
from tieredkv.cache.spill import write_bound
from tieredkv.cache.trace import BlockTrace
from tieredkv.config import CacheConfig, EngineConfig, read_yaml
from tieredkv.experiment.metrics import RequestRecord, Summary, summarize
from tieredkv.experiment.replay import ReplayWorkload
from tieredkv.experiment.spec import variants
from tieredkv.experiment.traces import prompt_token_ids
from tieredkv.experiment.workloads import (
    LongContextWorkload,
    LongDocQAWorkload,
    MultiTurnWorkload,
    describe_workload,
    make_workload,
)
from tieredkv.policy import CostModel, TierPolicy, needs_cost_model
from tieredkv.sampling import SamplingParams
from tieredkv.scheduler import Scheduler, SchedulerOutput
from tieredkv.sequence import Sequence as Seq
from tieredkv.tiers.backend import BlockRef, BlockStore
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.engine import TransferEngine, TransferJob

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "long_context_8b.yaml"
VOCAB = 128256  # llama-3-8b
TOKEN = 5  # what the simulated steps sample (no stop token)
Request = tuple[float, str, list[int], bool, int]  # arrival s, tag, prompt, returning, max tokens


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step: `step_s` + `token_s` per token + attention: `pair_s` per (query,
    key) pair of a prefill chunk (n new tokens after c computed: (c+n)^2 - c^2, as the whole
    prompt's a*N + b*N^2 fit counts them), `kv_read_s` per token of context a decode reads."""

    step_s: float
    token_s: float
    pair_s: float
    kv_read_s: float
    # the loop's time to launch a step, per token of it; None: the loop waits for each step's end.
    # Given, it waits only for steps that sample (as the engine does) and schedules ahead of the
    # GPU through the others (the scheduler sees the prefill not finished: `SimLaunched`)
    host_s_per_token: float | None = None
    host_s_per_step: float = 0.0  # and the fixed part of that time, each step's
    # the share of a step with prefill that its launch call waits to see run: the GPU's queue of
    # kernels holds the rest (an H200 running llama-3-8b: ~0.3, BENCHMARKS.md "Where the launch
    # time goes"); 0: the queue never fills. Decode steps, one graph each, never wait
    launch_waits: float = 0.0
    # the loop's time to submit one CPU-tier copy job, by direction (D2H, H2D), before the step's
    # launch: multi_turn_8b's store variant measured 1.55 / 1.88 ms on an H200 (BENCHMARKS.md,
    # "fifth sitting"); 0: the copies cost the loop nothing
    transfer_job_s: tuple[float, float] = (0.0, 0.0)

    def seconds(self, chunks: Sequence[tuple[int, int]]) -> float:
        """The step's time for chunks of (tokens computed before, new tokens)."""
        t = self.step_s
        for done, new in chunks:
            t += self.token_s * new
            t += self.kv_read_s * done if new == 1 else self.pair_s * ((done + new) ** 2 - done**2)
        return t


# llama-3-8b preset, bf16, one H200 (BENCHMARKS.md):
# - token_s, pair_s: a*N + b*N^2 through the three recompute-only prefills of bench_nvme_ttft
#   (16,384: 664.1 ms, 32,768: 1690.0 ms, 65,536: 4839.8 ms; the fit through the first and last
#   gives the middle one within 0.1%): a = 29.4 us/token, b = 6.78e-10 s/pair;
# - kv_read_s: decode attention of batch 64 x 2,048 context took 4.17 ms (bench_decode);
# - step_s: that decode step took 10.75 ms = step_s + 64 a + 64 * 2,048 kv_read_s.
H200_LLAMA_8B = StepCost(step_s=4.7e-3, token_s=2.94e-5, pair_s=6.78e-10, kv_read_s=3.18e-8)
# the same prefill fit and the H200's PCIe (53 GB/s each way, calibrated): what `auto` preemption weighs
H200_LLAMA_8B_COSTS = CostModel(d2h_bytes_per_s=53.3e9, h2d_bytes_per_s=53.8e9,
                                prefill_s_per_token=H200_LLAMA_8B.token_s,
                                prefill_s_per_token_sq=H200_LLAMA_8B.pair_s)
LLAMA_8B_TOKEN_BYTES = 128 << 10  # 32 layers x K and V x 8 heads x 128 x bf16
SIM_DISK_BYTES_PER_S = 1.5e9  # the GPU machine's disk: 1.45 GB/s measured (LIMITS.md), 1.5-2.4 GB/s seen by loads


class SimDisk(BlockStore):
    """A store below the CPU tier on the simulated clock (`clock()`, seconds): it holds
    `capacity` blocks (least recently written or read first out) and moves one block at a time
    each way at `bytes_per_s`, reads and writes side by side: on the GPU machine's disk a 16 MiB
    read behind 1 to 8 writes of 16 MiB in flight took 14.9-16.3 ms against 17.2 alone, and 8
    reads behind 8 writes 90 ms against 83 while those writes were done in 99 ms
    (`bench_nvme.py --behind-writes`, BENCHMARKS.md). No data moves (the simulated KV is never
    read)."""

    def __init__(self, capacity: int, block_bytes: int, bytes_per_s: float, clock: Callable[[], float]) -> None:
        self.capacity, self.block_s, self.clock = capacity, block_bytes / bytes_per_s, clock
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.queued: dict[str, deque[int]] = {"read": deque(), "write": deque()}
        # the job each way is moving, and when it finishes
        self.current: dict[str, tuple[int, float] | None] = {"read": None, "write": None}
        self.done: list[int] = []
        self.jobs = itertools.count()
        self.reads = self.writes = 0

    def next_finish(self) -> float | None:
        """When the next job on the disk finishes (None: the disk is idle)."""
        self._advance()
        return min((c[1] for c in self.current.values() if c is not None), default=None)

    def _advance(self) -> None:
        """Finish the jobs done by now, each next one started when the last one its way finished."""
        now = self.clock()
        for op, current in self.current.items():
            while current is not None and current[1] <= now:
                self.done.append(current[0])
                current = self._start_next(op, current[1])

    def _start_next(self, op: str, at: float) -> tuple[int, float] | None:
        queue = self.queued[op]
        self.current[op] = (queue.popleft(), at + self.block_s) if queue else None
        return self.current[op]

    def _submit(self, op: str, block_hash: int) -> int:
        self._advance()
        self.blocks.move_to_end(block_hash)
        job = next(self.jobs)
        self.queued[op].append(job)
        if self.current[op] is None:
            self._start_next(op, self.clock())
        return job

    def contains(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        return next((i for i, h in enumerate(block_hashes) if h not in self.blocks), len(block_hashes))

    def record(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        pass

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        self.blocks[ref.block_hash] = None
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        self.writes += 1
        return self._submit("write", ref.block_hash)

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        if ref.block_hash not in self.blocks:
            return None
        self.reads += 1
        return self._submit("read", ref.block_hash)

    def poll(self) -> list[tuple[int, bool]]:
        self._advance()
        done, self.done = self.done, []
        return [(job, True) for job in done]

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
        return dict.fromkeys(job_ids, True)  # (only at close: the clock stops there)

    def stats(self) -> dict[str, int | str | bool]:
        faults = dict.fromkeys(("corrupt", "io_errors", "enospc", "short_reads", "short_writes", "files_lost",
                                "internal_errors", "restored", "scan_discarded", "reformatted"), 0)
        return {"reads": self.reads, "writes": self.writes, "hits": self.reads, "slots_used": len(self.blocks),
                "slots_total": self.capacity, "bytes_read": 0, "bytes_written": 0, "backend": "sim", **faults}

    def close(self) -> None:
        pass


def simulate(engine_doc: dict, requests: list[Request], cost: StepCost, disk_bytes_per_s: float | None = None,
             replay_policies: bool = False) -> tuple[list, float, dict[str, Any]]:
    """Serve `requests` with the config's scheduler on a simulated clock, its store's disk (if
    any) moving `disk_bytes_per_s` each way (default `SIM_DISK_BYTES_PER_S`); the clients' records,
    the seconds until the last token and the scheduler's figures: its host seconds (wall
    clock, `loop_schedule_s`), its preemptions by kind and, with a CPU tier, the blocks copied
    into it (`d2h_blocks`, of them `demotions_kept`) and its hits. With `replay_policies`, also the CPU
    tier's block trace replayed under every replacement policy (`cpu_tier_replay`: the stream
    the tier served, as `tieredkv run` logs it)."""
    config = EngineConfig.from_dict(engine_doc)
    if config.cache.num_gpu_blocks is None:
        raise SystemExit("--sim needs cache.num_gpu_blocks in the config (the GPU tier the engine would have)")
    cache, cost_model = config.cache, config.scheduler.cost_model
    now = 0.0
    disk_bytes_per_s = disk_bytes_per_s or SIM_DISK_BYTES_PER_S
    offload = sim_cpu_tier(cache, lambda: now, disk_bytes_per_s)
    if replay_policies and offload is not None:
        offload.trace = BlockTrace()
    disk = offload.lower.store if offload is not None and offload.lower is not None else None
    kv = KVCacheManager(cache.num_gpu_blocks, cache.block_size, root_hash=1, offload=offload)
    preemption = config.scheduler.preemption if offload is not None else "recompute"
    if cost_model is None and needs_cost_model(config.scheduler.scheduling_policy, preemption, offload is not None,
                                               lower_tier=disk is not None):  # as the engine would measure one
        cost_model = H200_LLAMA_8B_COSTS
        if disk is not None:
            cost_model = dataclasses.replace(cost_model, disk_read_bytes_per_s=disk_bytes_per_s)
    policy = TierPolicy(preemption, LLAMA_8B_TOKEN_BYTES * cache.block_size, cache.block_size, cost_model)
    gpu = SimLaunched(lambda: now, cost.host_s_per_token, cost.launch_waits, cost.host_s_per_step) \
        if cost.host_s_per_token is not None else None
    sched = Scheduler(config.scheduler, kv, policy, gpu)
    sched.policy = policy  # pinned: the load rate it would learn is timed on the wall clock
    records, i, host_s, idle = {}, 0, 0.0, 0
    gpu_tokens = cache.num_gpu_blocks * cache.block_size
    while i < len(requests) or sched.has_unfinished():
        while i < len(requests) and requests[i][0] <= now:
            arrival, tag, prompt, returning, max_tokens = requests[i]
            records[tag] = RequestRecord(tag, arrival, returning, prompt_tokens=len(prompt))
            i += 1
            if len(prompt) + max_tokens > gpu_tokens:  # refused, as the engine refuses it (`RequestLimits`)
                records[tag].error, records[tag].finished = "longer than the GPU tier", True
                continue
            sched.add(Seq(tag, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        if not sched.has_unfinished():  # idle: the disk works on (the engine tends its tiers) until the next arrival
            wake = disk.next_finish() if disk is not None else None
            now = wake if wake is not None and wake < requests[i][0] else requests[i][0]
            kv.retire()
            continue
        jobs_before = _jobs_started(offload)
        start = time.perf_counter()
        kv.retire()
        out = sched.schedule()
        host_s += time.perf_counter() - start
        if not out.scheduled:  # its KV is landing from the CPU tier (by the next step), or from the disk
            now += _jobs_s(offload, jobs_before, cost)
            wakes = [t for t in (disk.next_finish() if disk is not None else None,
                                 gpu.next_end() if gpu is not None else None) if t is not None]
            idle = 0 if wakes else idle + 1
            assert idle < 100, "the scheduler made no progress"
            now = max(now + cost.step_s, min(wakes, default=0.0))
            continue
        idle = 0
        kv.before_forward()  # its demotions' copy jobs go before the launch, as the engine's
        now += _jobs_s(offload, jobs_before, cost)  # the loop's time submitting the step's copies
        step_s = cost.seconds([(s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled])
        if gpu is None:
            now += step_s
        else:  # launched behind the GPU's queue; the loop waits for it only where the step samples
            prefill = sum(s.num_new_tokens for s in out.scheduled
                          if s.seq.num_computed_tokens < s.seq.num_prompt_tokens)
            end, returned = gpu.launch(out.num_tokens, prefill, step_s)
            now = end if out.sampling else returned
        _book(sched, out, records, now)
    stats = {"loop_schedule_s": host_s, **{f"{kind}_preemptions": n for kind, n in sched.num_preemptions.items()},
             "refused": sum(r.error is not None for r in records.values()), "held_back": dict(sched.held_back)}
    if disk is not None:
        tiers = kv.stats()
        stats |= {"disk_reads": disk.reads, "late_loads": tiers["nvme_late_loads"],
                  "loaded_blocks": tiers["nvme_loaded_blocks"]}
    if offload is not None:  # the clock charges nothing for the copies
        stats |= {"d2h_blocks": offload.transfers.bytes_moved["d2h"] // offload.transfers.block_bytes,
                  "demotions_kept": offload.demoted_blocks, "cpu_hit_blocks": offload.hit_blocks}
    replayed = offload.replay() if offload is not None else None
    if replayed is not None:
        stats["cpu_tier_replay"] = replayed
    return list(records.values()), now, stats


def _jobs_started(offload: CPUOffload | None) -> tuple[int, int]:
    """The CPU tier's copy jobs started so far: D2H, H2D."""
    if offload is None:
        return 0, 0
    return offload.transfers.jobs_started["d2h"], offload.transfers.jobs_started["h2d"]


def _jobs_s(offload: CPUOffload | None, before: tuple[int, int], cost: StepCost) -> float:
    """The loop's seconds for the copy jobs started since `before` (`StepCost.transfer_job_s`)."""
    now = _jobs_started(offload)
    return sum((n - b) * job_s for n, b, job_s in zip(now, before, cost.transfer_job_s, strict=True))


class SimLaunched:
    """The GPU's queue (`GpuQueue`) on the simulated `clock`: the steps the simulated GPU has not finished
    (`launch`), a launch of `host_s_per_step` and `host_s_per_token` a token, and a launch call
    that waits for the GPU to run `launch_waits` of a step with prefill (the GPU's queue of
    kernels is full)."""

    def __init__(self, clock: Callable[[], float], host_s_per_token: float, launch_waits: float = 0.0,
                 host_s_per_step: float = 0.0) -> None:
        self.clock, self.host_s_per_token, self.launch_waits = clock, host_s_per_token, launch_waits
        self.host_s_per_step = host_s_per_step
        self.ends: deque[tuple[float, int]] = deque()  # when each step ends, its prefill tokens

    def launch(self, num_tokens: int, prefill_tokens: int, step_s: float) -> tuple[float, float]:
        """A step launched now, taking `step_s` on the GPU behind the steps before it: when it
        ends, and when the launch call returns to the loop."""
        launched = self.clock() + self.launch_s(num_tokens)
        start = max(launched, self.ends[-1][0] if self.ends else launched)
        self.ends.append((start + step_s, prefill_tokens))
        returned = max(launched, start + self.launch_waits * step_s) if prefill_tokens else launched
        return start + step_s, returned

    def next_end(self) -> float | None:
        return self.ends[0][0] if self.tokens() else None

    def tokens(self) -> int:
        while self.ends and self.ends[0][0] <= self.clock():
            self.ends.popleft()
        return sum(tokens for _, tokens in self.ends)

    def launch_s(self, tokens: int) -> float:
        return self.host_s_per_step + self.host_s_per_token * tokens


class SimTransfers(TransferEngine):
    """The CPU tier's copies on the simulated clock: each job finished as soon as it is
    submitted, nothing copied (the blocks' few bytes are never read), so that the scheduler's
    host time is its own, as on a GPU, where a copy is only queued. (Copied on the CPU, they
    took 85–90% of that time on multi_turn_8b's CPU-tier variants.)"""

    def _start(self, job_id: int, job: TransferJob) -> None:
        self._finished.append(job_id)


def sim_cpu_tier(cache: CacheConfig, clock: Callable[[], float], disk_bytes_per_s: float) -> CPUOffload | None:
    """The config's CPU tier, `cpu_cache_bytes` in blocks of llama-3-8b's size, over a GPU tier
    on the CPU; each token of a block holds 16 bytes (the scheduler counts blocks, not bytes).
    With `nvme_path`, a `SimDisk` of `nvme_bytes` below it, on the simulated `clock`."""
    block_bytes = LLAMA_8B_TOKEN_BYTES * cache.block_size
    num_blocks = cache.cpu_cache_bytes // block_bytes
    if num_blocks == 0:
        return None
    gpu = torch.zeros((1, 2, cache.num_gpu_blocks, cache.block_size, 1, 4), dtype=torch.bfloat16)
    tier = CPUTier(num_blocks, tuple(gpu[:, :, 0].shape), gpu.dtype, pin=False)
    disk = None
    if cache.nvme_path is not None:
        disk = SimDisk(cache.nvme_bytes // block_bytes, block_bytes, disk_bytes_per_s, clock)
    offload = CPUOffload(tier, SimTransfers(gpu, tier.data), disk, policy=cache.cpu_policy)
    if offload.lower is not None:  # the engine's bound, for blocks of llama-3-8b's size (the tier's hold a few bytes)
        offload.lower.spill.max_writes = write_bound(block_bytes)
    return offload


def _book(sched: Scheduler, out: SchedulerOutput, records: dict[str, RequestRecord], now: float) -> None:
    sched.update(out, [TOKEN] * len(out.sampling))
    for seq in out.sampling:
        records[seq.request_id].token_times.append(now)
        records[seq.request_id].finished = seq.is_finished
        records[seq.request_id].cached_tokens = seq.num_cached_tokens


def serve(engine_doc: dict, requests: list[Request]) -> tuple[list, float]:
    """Serve `requests` with `LLMEngine` on the wall clock (after a warm-up); the clients'
    records and the seconds until the last token."""
    import torch

    from tieredkv.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_dict(engine_doc))
    _warm_up(engine)
    records, i = {}, 0
    start = time.perf_counter()
    while i < len(requests) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(requests) and requests[i][0] <= now:
            arrival, tag, prompt, returning, max_tokens = requests[i]
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=tag)
            records[tag] = RequestRecord(tag, arrival, returning, prompt_tokens=len(prompt))
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, requests[i][0] - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for o in outputs:
            record = records[o.request_id]
            record.token_times += [now] * (len(o.token_ids) - len(record.token_times))
            record.finished = o.finished
    elapsed = time.perf_counter() - start
    engine.close()
    del engine
    gc.collect()  # the model, its CUDA graphs and KV cache, before the next variant's
    torch.cuda.empty_cache()
    return list(records.values()), elapsed


def _warm_up(engine) -> None:
    """Compile and tune the kernels on prefills of several lengths and a few decodes."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i, n in enumerate((512, 4096, 20000)):
        engine.add_request([FIRST_ID + (i * 7 + j) % 1000 for j in range(n)], params, request_id=f"warmup{i}")
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()


FIRST_ID = 4


Planned = LongContextWorkload | LongDocQAWorkload | ReplayWorkload  # workloads whose every request is known ahead


def workload_of(doc: dict, trace: str | None, **keys: float | None) -> Planned:
    """The config's workload, or with `trace` a replay of that Mooncake trace with full-length
    prompts and real output lengths; `keys` (rate, requests, seed, a replay's speed; fraction, start_s,
    duration_s of a trace) replace the workload's where given."""
    given = {k: v for k, v in keys.items() if v is not None}
    if trace is not None:
        section = {"kind": "replay", "path": trace, "format": "mooncake", "max_output_tokens": None,
                   **{k: v for k, v in given.items() if k != "requests"}}
        if "requests" in given:
            section["max_requests"] = given["requests"]
        return make_workload(section)
    section = {**(doc.get("workload") or {}), **given}
    if "rate" in given:
        section.pop("speed", None)  # a replay's arrivals are set by one or the other
    workload = make_workload(section)
    if not isinstance(workload, Planned):
        raise SystemExit(f"the config's workload is {section.get('kind')!r}; this benchmark runs kind: "
                         "long_context, long_doc_qa or replay (or a trace: --trace)")
    return workload


def plan_of(workload: Planned) -> list[Request]:
    """Every request of the workload, in arrival order."""
    if not isinstance(workload, ReplayWorkload):
        return [(*r, workload.max_tokens) for r in workload.plan(VOCAB)]
    blocks: dict[int, list[int]] = {}
    return [(r.time_s, f"line{r.line.line}", prompt_token_ids(r.line, workload.block_tokens, VOCAB, workload.seed,
                                                              blocks), r.returning, workload.output_tokens(r))
            for r in workload.requests]


def plan_of_run(doc: dict, path: str, speed: float | None) -> list[Request]:
    """The requests of a `tieredkv run` of the config's `multi_turn` workload (its result.json at
    `path`), open-loop: each turn sent when it was in that run (its time from the start divided
    by `speed`), its prompt the conversation so far with the answers the run gave. A closed loop
    sends a turn once the last one is answered; replayed, a slower variant meets the same
    arrivals (the simulated clock runs no closed loop)."""
    workload = make_workload(doc.get("workload") or {})
    if not isinstance(workload, MultiTurnWorkload):
        kind = describe_workload(workload)["kind"]
        raise SystemExit(f"--arrivals replays a multi_turn run; the config's workload is {kind!r}")
    try:
        run = json.loads(Path(path).read_text())
        recorded = {r["tag"]: r for r in run["requests"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--arrivals {path}: not a result.json of `tieredkv run` ({e})") from None
    if run.get("workload") != describe_workload(workload):
        raise SystemExit(f"--arrivals {path}: its workload {run.get('workload')} is not the config's")
    system, messages = workload.messages(random.Random(workload.seed), VOCAB)
    requests = []
    for u, turns in enumerate(messages):
        history = list(system)
        for t, message in enumerate(turns):
            history += message
            r = recorded.get(f"user{u}/turn{t}")
            if r is None or not r.get("finished"):
                raise SystemExit(f"--arrivals {path}: user{u}/turn{t} did not finish in that run")
            requests.append((r["arrival"] / (speed or 1.0), f"user{u}/turn{t}", list(history), t > 0,
                             workload.max_tokens))
            history += r["output_token_ids"]
    return sorted(requests, key=lambda r: r[0])


def engines_of(doc: dict, names: str | None, vary: str | None, policies: str | None,
               settings: Sequence[str]) -> list[tuple[str, dict]]:
    """(name, engine config) of each variant to run: the config's (those in `names`), or with
    `policies` ("fcfs,ttft,hrrn") the config's base engine under each scheduling policy; with
    `vary` ("prefill_aging=0.05,0.2"), the last one again with that scheduler key at each value.
    `settings` ("scheduler.max_num_batched_tokens=8192") apply to every one."""
    if policies:
        base = {k: v for k, v in doc.items() if k not in ("variants", "workload", "sweep", "slo", "name")}
        engines = [(p, {**base, "scheduler": {**base.get("scheduler", {}), "scheduling_policy": p}})
                   for p in policies.split(",")]
    else:
        engines = [(name.split("/", 1)[-1], engine_doc) for name, engine_doc in variants(doc, compare=True)]
    if names:
        engines = [(n, d) for n, d in engines if n in names.split(",")]
    if vary:
        key, _, values = vary.partition("=")
        base = engines[-1][1]
        for value in values.split(","):
            engines.append((f"{key}={value}", {**base, "scheduler": {**base.get("scheduler", {}), key: value}}))
    return [(name, _with_settings(engine_doc, settings)) for name, engine_doc in engines]


def _with_settings(engine_doc: dict, settings: Sequence[str]) -> dict:
    """`engine_doc` with each "section.key=value" (a YAML value) set."""
    doc = dict(engine_doc)
    for setting in settings:
        path, _, value = setting.partition("=")
        section, _, key = path.partition(".")
        if not key:
            raise SystemExit(f"--set {setting!r}: write section.key=value, e.g. scheduler.max_num_batched_tokens=8192")
        doc[section] = {**(doc.get(section) or {}), key: yaml.safe_load(value)}
    return doc


def slowest(records: list[RequestRecord]) -> RequestRecord:
    """The request with the longest TTFT (the first of them)."""
    return max(records, key=lambda r: r.ttft or 0.0)


def row(summary: Summary, first: Summary | None, last: RequestRecord) -> str:
    """One variant's figures (ms), `last` its slowest request: its TTFT and prompt length."""
    ms = {"ttft50": summary.ttft_s["p50"], "ttft90": summary.ttft_s["p90"], "ttft99": summary.ttft_s["p99"],
          "ttftmax": last.ttft, "itl50": summary.itl_s["p50"], "itl99": summary.itl_s["p99"],
          "tpot90": summary.tpot_s["p90"]}
    cells = [f"{summary.name:<28}"] + [f"{v * 1e3:9.0f}" for v in ms.values()] + [f"{last.prompt_tokens:9d}"]
    cells += [f"{summary.elapsed_s:8.1f}", f"{tokens_per_s(summary):9.0f}"]
    if first is not None:
        cells.append("   " + "  ".join(f"{v:5.2f}x" for v in ratios(first, summary).values()))
    return " ".join(cells)


def tokens_per_s(summary: Summary) -> float:
    return (summary.prompt_tokens + summary.output_tokens) / summary.elapsed_s


def ratios(first: Summary, other: Summary) -> dict[str, float]:
    """How many times lower `other`'s TTFT p50 / p90 / p99 and ITL p99 are, and its throughput
    over `first`'s."""
    return {"ttft_p50": first.ttft_s["p50"] / other.ttft_s["p50"],
            "ttft_p90": first.ttft_s["p90"] / other.ttft_s["p90"],
            "ttft_p99": first.ttft_s["p99"] / other.ttft_s["p99"],
            "itl_p99": first.itl_s["p99"] / other.itl_s["p99"],
            "throughput": tokens_per_s(other) / tokens_per_s(first)}


HEADER = (f"{'variant':<28} {'TTFT p50':>9} {'p90':>9} {'p99':>9} {'max':>9} {'ITL p50':>9} {'p99':>9}"
          f" {'TPOT p90':>9} {'slowest':>9}"
          f" {'wall s':>8} {'tok/s':>9}   vs the first: TTFT p50, p90, p99 and ITL p99 x lower, throughput x\n"
          "(slowest: the prompt tokens of the request with the max TTFT)")


def launch_fits(paths: Sequence[str], names: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Each variant's launch time as `tieredkv run` measured it in one of `paths` (its
    result.json, named by the run's variant): (`launch_s_fixed`, `launch_s_per_token`)."""
    found: dict[str, tuple[float, float]] = {}
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
            name, stats = run["name"].split("/")[1], run["summary"]["stats"]
            found[name] = (stats["launch_s_fixed"], stats["launch_s_per_token"])
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise SystemExit(f"--launch-from {path}: not a result.json of `tieredkv run` with the loop's launch "
                             f"time ({e!r})") from None
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"--launch-from: no run of {', '.join(missing)} among those given "
                         f"({', '.join(sorted(found)) or 'none'})")
    return found


def run_point(doc: dict, engines: list[tuple[str, dict]], sim: bool, trace: str | None, bound: bool = False,
              sim_cost: StepCost = H200_LLAMA_8B, disk_bytes_per_s: float | None = None, arrivals: str | None = None,
              replay_policies: bool = False, launches: dict[str, tuple[float, float]] | None = None,
              **keys: float | None) -> list[tuple[Summary, RequestRecord]]:
    """Every variant on one workload (one rate, one seed; or with `arrivals`, a multi_turn run's
    requests: `plan_of_run`); prints a table (and with `bound`, `print_bound`), returns the
    summaries and each variant's slowest request. With `sim`, steps take `sim_cost`'s time and a
    store's disk moves `disk_bytes_per_s` each way; with `replay_policies` too, each variant's CPU
    tier trace is replayed under every policy (`simulate`); with `launches` (`launch_fits`), each
    variant's loop takes its own launch time, (per step, per token) seconds."""
    if arrivals is not None:
        requests, source = plan_of_run(doc, arrivals, keys.get("speed")), f"the turns of {arrivals}"
    else:
        workload = workload_of(doc, trace, **keys)
        requests, source = plan_of(workload), f"seed {workload.seed}, rate {workload.rate}/s"
    tokens = sum(len(r[2]) for r in requests)
    outputs = sum(r[4] for r in requests)
    print(f"\n{len(requests)} requests ({source}), {tokens} prompt tokens (mean "
          f"{tokens / len(requests):.0f}, max {max(len(r[2]) for r in requests)}), {outputs} output tokens, "
          f"arrivals over {requests[-1][0]:.0f} s; {'simulated H200 clock' if sim else 'engine, wall clock'}")
    print(HEADER, flush=True)
    summaries, runs = [], []
    for name, engine_doc in engines:
        stats = {}
        if sim:
            cost = sim_cost
            if launches is not None:
                per_step, per_token = launches[name]
                cost = dataclasses.replace(sim_cost, host_s_per_step=per_step, host_s_per_token=per_token)
            records, elapsed, stats = simulate(engine_doc, requests, cost, disk_bytes_per_s, replay_policies)
        else:
            records, elapsed = serve(engine_doc, requests)
        assert all(r.finished for r in records), f"{name}: a request did not finish"
        summaries.append((summarize(name, records, elapsed, stats), slowest(records)))
        print(row(summaries[-1][0], summaries[0][0] if len(summaries) > 1 else None, summaries[-1][1]), flush=True)
        if sim:
            print(f"{'':<28} the scheduler's host time: {stats['loop_schedule_s']:.2f} s; preemptions: "
                  f"{stats['swap_preemptions']} swapped, {stats['recompute_preemptions']} recomputed"
                  + (f"; the disk: {stats['disk_reads']} reads, {stats['loaded_blocks']} blocks loaded, "
                     f"{stats['late_loads']} given up late" if "disk_reads" in stats else "")
                  + (f"; {stats['refused']} refused (longer than the GPU tier)" if stats["refused"] else "")
                  + (f"; prompts held back (sequence steps): {stats['held_back']}" if stats["held_back"] else ""),
                  flush=True)
            if "cpu_tier_replay" in stats:
                rates = stats["cpu_tier_replay"]["hit_rate"]
                print(f"{'':<28} the CPU tier's trace replayed: "
                      + ", ".join(f"{policy} {rate:.1%}" for policy, rate in rates.items()), flush=True)
        runs.append(records)
    if bound:
        print_bound(runs, sim_cost)
    return summaries


def print_bound(runs: list[list[RequestRecord]], cost: StepCost) -> None:
    """The least TTFT p99 any prefill order could give (`tail_bound`) with the max TTFT held
    to 1, 1.25 and 1.5 times the lowest of `runs` (and with no hold), each request's work its
    prefill alone after the most cached prefix any run found."""
    from tail_bound import exceptions_of, least_tail  # a sibling module: on the path when run as a script

    cached: dict[str, int] = {}
    for r in (r for records in runs for r in records):
        cached[r.tag] = max(cached.get(r.tag, 0), r.cached_tokens)
    jobs = [(r.arrival, cost.token_s * (r.prompt_tokens - cached[r.tag])
             + cost.pair_s * (r.prompt_tokens**2 - cached[r.tag] ** 2)) for r in runs[0] if r.error is None]
    exceptions = exceptions_of(len(jobs))
    if exceptions > 1:
        print(f"bound: p99 of {len(jobs)} requests leaves {exceptions} above it; --bound takes one at most")
        return
    lowest = min(slowest(rs).ttft for rs in runs)
    cells = [f"max <= {m:.2f}x ({lowest * m * 1e3:.0f}): p99 >= {least_tail(jobs, lowest * m, exceptions) * 1e3:.0f}"
             for m in (1.0, 1.25, 1.5)]
    print(f"bound (one clairvoyant server, prefill work only, no memory limit; ms): {'; '.join(cells)}; "
          f"no max: p99 >= {least_tail(jobs, float('inf'), exceptions) * 1e3:.0f}")


def print_means(rate: float | None, points: list[list[Summary]]) -> None:
    """Each variant's ratios to the first, averaged over the runs (seeds and perturbations;
    geometric mean)."""
    print(f"\nrate {rate}: ratios to {points[0][0].name}, geometric mean over {len(points)} runs "
          "(seeds x perturbations)")
    for i in range(1, len(points[0])):
        each = [ratios(p[0], p[i]) for p in points]
        means = {k: statistics.geometric_mean(r[k] for r in each) for k in each[0]}
        print(f"  {points[0][i].name:<28} " + "  ".join(f"{k} {v:5.2f}x" for k, v in means.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG))
    parser.add_argument("--sim", action="store_true", help="simulated clock on the CPU (no model)")
    parser.add_argument("--rates", help="arrival rates to run, e.g. 0.6,0.8 (default: the config's)")
    parser.add_argument("--speed", type=float, help="a replay's speed (its arrival gaps divided by it; "
                                                    "default: the config's)")
    parser.add_argument("--requests", type=int, help="number of requests (default: the config's)")
    parser.add_argument("--seeds", help="workload seeds, e.g. 0,1,2 (default: the config's)")
    parser.add_argument("--variants", help="comma-separated variant names to run (default: all)")
    parser.add_argument("--policies", help="instead of the config's variants, its base engine under each "
                                           "scheduling policy, e.g. fcfs,ttft,hrrn")
    parser.add_argument("--reverse", action="store_true", help="run the variants in reverse order")
    parser.add_argument("--vary", help="also run the last variant with a scheduler key at each value, "
                                       "e.g. prefill_aging=0.05,0.2")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="set an engine key in every variant, e.g. scheduler.max_num_batched_tokens=8192")
    parser.add_argument("--trace", help="replay this Mooncake JSONL trace (full-length prompts, real output "
                                        "lengths) instead of the config's workload")
    parser.add_argument("--fraction", type=float, help="with --trace: the share of its conversations replayed")
    parser.add_argument("--start-s", type=float, help="with --trace: where the replayed window starts (s)")
    parser.add_argument("--duration-s", type=float, help="with --trace: the replayed window's length (s)")
    parser.add_argument("--bound", action="store_true", help="with --sim: also the least TTFT p99 any prefill "
                                                             "order could give (benchmarks/tail_bound.py)")
    parser.add_argument("--disk-gbps", type=float, help="with --sim: the simulated disk's GB/s each way "
                                                           f"(default {SIM_DISK_BYTES_PER_S / 1e9:g})")
    parser.add_argument("--step-ms", type=float,
                        help="with --sim: a step's fixed time in ms (default: the H200 preset's "
                             f"{H200_LLAMA_8B.step_s * 1e3:g}, a decode microbenchmark's; 9 reproduces the engine's "
                             "serving figures on the conversation slice: BENCHMARKS.md, \"A simulated clock that "
                             "serves like the engine\")")
    parser.add_argument("--host-us-per-token", type=float,
                        help="with --sim: the loop's time to launch a step, in us per token of it; the loop then "
                             "waits only for steps that sample and schedules ahead of the GPU through the others "
                             "(default: it waits for every step)")
    parser.add_argument("--launch-waits", type=float, default=0.0,
                        help="with --host-us-per-token: the share of a step with prefill its launch call waits "
                             "to see run on the GPU, whose queue of kernels holds the rest (~0.3 measured on an "
                             "H200; default 0: the queue never fills)")
    parser.add_argument("--launch-from", nargs="+", metavar="RESULT_JSON",
                        help="with --sim: each variant's loop takes the launch time (per step and per token) "
                             "that `tieredkv run` measured for it, in one of these result.json files (one a "
                             "variant), and schedules ahead of the GPU as with --host-us-per-token")
    parser.add_argument("--transfer-host-ms", metavar="D2H,H2D",
                        help="with --sim: the loop's time to submit one CPU-tier copy job of each direction, "
                             "charged before the step's launch (1.55,1.88 measured in serving on an H200: "
                             "BENCHMARKS.md; default: none)")
    parser.add_argument("--perturb", default="1",
                        help="with --sim: scale each step's fixed time by these factors, each a run (e.g. "
                             "1,1.001,1.002): how far a figure moves under a change too small to matter, and "
                             "the variants' ratios averaged over it (BENCHMARKS.md)")
    parser.add_argument("--arrivals", metavar="RESULT_JSON",
                        help="a multi_turn config: replay that `tieredkv run`'s turns open-loop, at the times "
                             "they were sent (divided by --speed), with the answers it gave")
    parser.add_argument("--replay-policies", action="store_true",
                        help="with --sim: also replay each variant's CPU tier block trace (the stream it served) "
                             "under every replacement policy, with Belady's, and print the hit rates")
    parser.add_argument("--json", help="write every summary here")
    args = parser.parse_args()
    try:
        factors = [float(f) for f in args.perturb.split(",")]
    except ValueError:
        raise SystemExit(f"--perturb: expected factors like 1,1.001, got {args.perturb!r}") from None
    if not all(f > 0 for f in factors):
        raise SystemExit(f"--perturb: expected positive factors, got {args.perturb!r}")
    if (args.bound or args.disk_gbps or args.step_ms or args.host_us_per_token is not None or args.launch_from
            or factors != [1.0] or args.replay_policies or args.transfer_host_ms) and not args.sim:
        raise SystemExit("--bound, --disk-gbps, --step-ms, --host-us-per-token, --launch-from, --perturb, "
                         "--replay-policies and --transfer-host-ms take the simulated clock: add --sim")
    try:
        job_s = tuple(float(ms) / 1e3 for ms in (args.transfer_host_ms or "0,0").split(","))
    except ValueError:
        job_s = ()
    if len(job_s) != 2 or not all(s >= 0 for s in job_s):
        raise SystemExit(f"--transfer-host-ms: expected two numbers >= 0 like 1.55,1.88, got {args.transfer_host_ms!r}")
    if args.launch_from and args.host_us_per_token is not None:
        raise SystemExit("--launch-from gives each variant its launch time: drop --host-us-per-token")
    for flag, value in (("--disk-gbps", args.disk_gbps), ("--step-ms", args.step_ms)):
        if value is not None and not value > 0:
            raise SystemExit(f"{flag}: expected a positive number, got {value}")
    if args.arrivals is not None:  # the run's requests, as they came: nothing draws others
        drawn = [flag for flag, value in (("--trace", args.trace), ("--rates", args.rates), ("--seeds", args.seeds),
                                          ("--requests", args.requests)) if value is not None]
        if drawn:
            raise SystemExit(f"--arrivals replays a run's own requests: drop {', '.join(drawn)}")
    if args.host_us_per_token is not None and not args.host_us_per_token >= 0:
        raise SystemExit(f"--host-us-per-token: expected a number >= 0, got {args.host_us_per_token}")
    if args.launch_waits and args.host_us_per_token is None and not args.launch_from:
        raise SystemExit("--launch-waits takes the loop ahead of the GPU: add --host-us-per-token or --launch-from")
    if not 0 <= args.launch_waits <= 1:
        raise SystemExit(f"--launch-waits: expected a share from 0 to 1, got {args.launch_waits}")
    step_s = args.step_ms / 1e3 if args.step_ms else H200_LLAMA_8B.step_s
    host_s = args.host_us_per_token / 1e6 if args.host_us_per_token is not None else None
    sim_costs = [dataclasses.replace(H200_LLAMA_8B, step_s=step_s * f, host_s_per_token=host_s,
                                     launch_waits=args.launch_waits, transfer_job_s=job_s) for f in factors]
    disk_bytes_per_s = args.disk_gbps * 1e9 if args.disk_gbps else None
    doc = read_yaml(args.config)
    workload = doc.get("workload") or {}
    if workload.get("kind") == "replay" and "path" in workload:  # relative to the config, as `tieredkv run` reads it
        workload["path"] = str(Path(args.config).parent / workload["path"])
    engines = engines_of(doc, args.variants, args.vary, args.policies, args.set)
    if args.reverse:
        engines.reverse()
    launches = launch_fits(args.launch_from, (name for name, _ in engines)) if args.launch_from else None
    window = {"fraction": args.fraction, "start_s": args.start_s, "duration_s": args.duration_s}
    results = []
    for rate in [float(r) for r in args.rates.split(",")] if args.rates else [None]:
        points = [run_point(doc, engines, args.sim, args.trace, args.bound, sim_cost, disk_bytes_per_s, args.arrivals,
                            args.replay_policies, launches,
                            rate=rate, requests=args.requests,
                            seed=seed, speed=args.speed, **window)
                  for seed in ([int(s) for s in args.seeds.split(",")] if args.seeds else [None])
                  for sim_cost in sim_costs]
        if len(points) > 1:
            print_means(rate, [[s for s, _ in p] for p in points])
        results += [{"rate": rate, **dataclasses.asdict(s), "ttft_max_s": last.ttft,
                     "slowest_prompt_tokens": last.prompt_tokens} for summaries in points for s, last in summaries]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
