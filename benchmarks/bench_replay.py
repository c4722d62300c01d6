"""The CPU tier's and the NVMe store's replacement policies replayed offline (CPU, no model,
~30 s each): for each trace and tier size, the tier's hit rate (leading hit blocks of each
request over the blocks asked of the tier) under lru, tinylfu, adaptive (the default), arc and
wtinylfu (policies that choose their own victims, not in the engine) and Belady's MIN with bypass.
"vs best": each of adaptive, arc and wtinylfu minus max(lru, tinylfu), points.

Traces, each derived with no model by `cache/trace.py`'s `simulate` (a GPU tier of cached
blocks in LRU order, offering what it evicts, asking the CPU tier for the blocks past its hits):
- `multi_turn_8b`: configs/multi_turn_8b.yaml's workload at its block size (16 tokens, 2 MiB a
  block of llama-3-8b KV) and GPU tier (2,048 blocks, 4 GiB); turn t of a user starts t x
  (think time + `--turn-s`, an assumed service time) after the user's Poisson arrival;
  tiers of 4, 8 and 16 GiB.
- the Mooncake FAST'25 conversation and synthetic traces (configs/mooncake_*_slice.jsonl, or
  full files given with --conversation / --synthetic), at the traces' own 512-token blocks
  (64 MiB of llama-3-8b KV each: one trace block stands for 32 engine blocks with the sizes
  scaled to match), full-length prompts, a 16 GiB GPU tier; tiers of 4, 16 and 64 GiB.

`--tier store`: the NVMe store below a CPU tier under its default policy (adaptive). The store
is offered each block the CPU tier lets go (evicted, or turned down by its admission) and asked
for each request's blocks past the CPU tier's leading hits; it is replayed through the store's
own index (`tiers/nvme/slot_index.py`, chain parents from the requests); arc and wtinylfu, which
the index cannot express, through the offline tier of `cache/trace.py` `replay`. multi_turn_8b: a 4 GiB
CPU tier, stores of 4, 8 and 16 GiB; Mooncake: a 16 GiB CPU tier, stores of 16, 40 and 128 GiB.

`--slices N` (with full traces): held-out slices instead of one matrix. Each Mooncake trace is
sampled N times (`experiment/traces.py` `select`: a `--fraction` of its conversations, seeds
`--seed` .. `--seed` + N - 1) and multi_turn_8b is drawn with N arrival seeds; for each tier size
it prints the worst and the mean over slices of adaptive - max(lru, tinylfu), and the same for arc
and wtinylfu (Belady is skipped).

    python benchmarks/bench_replay.py
    python benchmarks/bench_replay.py --tier store
    python benchmarks/bench_replay.py --synthetic /data/synthetic_trace.jsonl   # a full trace
    python benchmarks/bench_replay.py --slices 8 --fraction 0.05 --conversation ... --synthetic ...
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml

from tieredkv.cache.trace import EVICTING, REPLAY_POLICIES, BlockTrace, ReplayPolicy, ReplayResult, replay, simulate
from tieredkv.experiment.traces import TraceLine, read_trace, select
from tieredkv.replacement import GhostTier, ReplacementPolicy, make_admission
from tieredkv.tiers.nvme.slot_index import Reservation, SlotIndex

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GiB = 1 << 30
ENGINE_BLOCK_BYTES = 2 << 20  # one 16-token block of llama-3-8b KV (bfloat16)
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash ids
TRACE_BLOCK_BYTES = ENGINE_BLOCK_BYTES * TRACE_BLOCK_TOKENS // 16
MOONCAKE_GPU_BYTES = 16 * GiB
ONLINE: tuple[ReplayPolicy, ...] = ("lru", "tinylfu", "adaptive", "arc", "wtinylfu")
BASELINES = ("lru", "tinylfu", "belady")  # the rest are judged against max(lru, tinylfu)

Requests = list[tuple[tuple[int, ...], tuple[int, ...]]]
Results = dict[ReplayPolicy, ReplayResult]


def multi_turn_requests(config: Path, turn_s: float, seed: int | None = None) -> tuple[Requests, int]:
    """The multi-turn workload's requests as block chains, in time order, and the GPU blocks
    (arrivals drawn with `seed`, by default the config's)."""
    spec = yaml.safe_load(config.read_text())
    w, block = spec["workload"], spec["cache"]["block_size"]
    system = w["system_prompt_tokens"] // block
    rng = random.Random(w["seed"] if seed is None else seed)
    arrival, timed = 0.0, []
    for user in range(w["users"]):
        arrival += rng.expovariate(w["rate"])
        tokens = w["system_prompt_tokens"]
        for turn in range(w["turns"]):
            tokens += w["first_message_tokens"] if turn == 0 else w["message_tokens"]
            prompt, cached = tokens // block, (tokens + w["max_tokens"]) // block
            chain = tuple(i if i < system else (user + 1) << 32 | i for i in range(cached))
            timed.append((arrival + turn * (w["think_time_s"] + turn_s), chain[:prompt], chain))
            tokens += w["max_tokens"]
    timed.sort(key=lambda r: r[0])
    return [(prompt, cached) for _, prompt, cached in timed], spec["cache"]["num_gpu_blocks"]


def mooncake_requests(lines: list[TraceLine]) -> Requests:
    """Every line's full 512-token blocks, in time order."""
    lines = sorted(lines, key=lambda line: line.time_s)
    chains = [line.hash_ids[: line.input_length // TRACE_BLOCK_TOKENS] for line in lines]
    return [(chain, chain) for chain in chains]


def cpu_results(requests: Requests, gpu_blocks: int, block_bytes: int, tier_gib: tuple[float, ...],
                policies: tuple[ReplayPolicy, ...] = REPLAY_POLICIES) -> list[Results]:
    """The CPU tier's replay under each policy, for each tier size."""
    trace = simulate(requests, gpu_blocks)
    return [{p: replay(trace, int(gib * GiB) // block_bytes, p) for p in policies} for gib in tier_gib]


def store_trace(trace: BlockTrace, cpu_blocks: int) -> BlockTrace:
    """What reaches the store below a CPU tier of `cpu_blocks` under the adaptive policy (module
    docstring): the blocks the CPU tier lets go, and each request's blocks past its CPU hits."""
    admission, cpu = make_admission("adaptive", cpu_blocks), GhostTier(cpu_blocks)
    store = BlockTrace()
    for event in trace.events:
        if isinstance(event, tuple):
            admission.record(event)
            store.request(event[cpu.request(event):])
        else:
            admission.offered(event)
            left = cpu.offer(event, admission.admits)
            if left is not None:
                store.offer(left)
    return store


def replay_store(trace: BlockTrace, slots: int, policy: ReplacementPolicy, parents: dict[int, int]) -> ReplayResult:
    """The store's trace through the store's index under `policy`: offers are written (if the
    index gives a slot); a request is recorded, and its leading stored blocks are read in order."""
    index = SlotIndex(slots, policy)
    requested = hits = alone = 0
    for event in trace.events:
        if isinstance(event, int):
            index.offered(event)
            if index.known(event):
                index.touch(event)
            elif isinstance(index.reserve(event, parents.get(event)), Reservation):
                index.commit(event)
            continue
        index.record(event)
        requested += len(event)
        alone += sum(index.lookup(h) is not None for h in event)
        for block_hash in event:
            if index.lookup(block_hash) is None:
                break
            index.touch(block_hash)
            hits += 1
    return ReplayResult(requested, hits, alone)


def store_results(requests: Requests, gpu_blocks: int, block_bytes: int, cpu_gib: int, store_gib: tuple[int, ...],
                  policies: tuple[ReplayPolicy, ...] = REPLAY_POLICIES) -> list[Results]:
    """The store's replay below a CPU tier of `cpu_gib` under each policy, for stores of `store_gib`."""
    trace = store_trace(simulate(requests, gpu_blocks), cpu_gib * GiB // block_bytes)
    parents = {child: parent for _, chain in requests for parent, child in zip(chain, chain[1:], strict=False)}
    found = []
    for gib in store_gib:
        slots = gib * GiB // block_bytes
        found.append({p: replay(trace, slots, p) if p == "belady" or p in EVICTING
                      else replay_store(trace, slots, p, parents) for p in policies})
    return found


def margin(results: Results, policy: ReplayPolicy = "adaptive") -> float:
    """`policy`'s hit rate minus the better of LRU's and TinyLFU's."""
    rates = {p: result.hit_rate for p, result in results.items()}
    return rates[policy] - max(rates["lru"], rates["tinylfu"])


def judged(policies: Iterable[ReplayPolicy]) -> list[ReplayPolicy]:
    """Those of `policies` judged against max(lru, tinylfu)."""
    return [p for p in policies if p not in BASELINES]


def matrix_row(name: str, gib: float, results: Results) -> str:
    cells = " ".join(f"{100 * results[p].hit_rate:8.1f}" for p in REPLAY_POLICIES)
    margins = " ".join(f"{100 * margin(results, p):+9.1f}" for p in judged(results))
    return f"{name:24} {gib:5g} GiB {cells} {margins}"


def slice_row(name: str, gib: float, seeds: list[int], slices: list[Results]) -> str:
    """Each policy's mean hit rate over slices, and for each judged one the worst (and its seed)
    and the mean of `margin`."""
    means = " ".join(f"{100 * statistics.mean(r[p].hit_rate for r in slices):8.1f}" for p in slices[0])
    row = f"{name:36} {gib:5g} GiB {means}"
    for policy in judged(slices[0]):
        margins = [margin(results, policy) for results in slices]
        worst = min(range(len(slices)), key=margins.__getitem__)
        row += f" {100 * margins[worst]:+7.1f} (seed {seeds[worst]:2}) {100 * statistics.mean(margins):+7.1f}"
    return row


Workload = tuple[str, Requests, int, int]  # (name, requests, GPU blocks, block bytes)
Sizes = tuple[str, int, tuple[int, ...]]  # (row name suffix, CPU GiB above the store, tier sizes)


def tier_sizes(tier: str, block_bytes: int) -> Sizes:
    """The tier sizes of the module docstring: multi_turn_8b's engine blocks, or Mooncake's."""
    if tier == "store":
        engine = (" (CPU 4 GiB)", 4, (4, 8, 16))
        return engine if block_bytes == ENGINE_BLOCK_BYTES else (" (CPU 16 GiB)", 16, (16, 40, 128))
    return ("", 0, (4, 8, 16)) if block_bytes == ENGINE_BLOCK_BYTES else ("", 0, (4, 16, 64))


def results_for(
    tier: str, workload: Workload, policies: tuple[ReplayPolicy, ...]
) -> tuple[str, tuple[int, ...], list[Results]]:
    """A workload's replay on the tier: its row name, tier sizes and results per size."""
    name, requests, gpu_blocks, block_bytes = workload
    suffix, cpu_gib, sizes = tier_sizes(tier, block_bytes)
    if tier == "store":
        return name + suffix, sizes, store_results(requests, gpu_blocks, block_bytes, cpu_gib, sizes, policies)
    return name, sizes, cpu_results(requests, gpu_blocks, block_bytes, sizes, policies)


def print_matrix(tier: str, workloads: list[Workload]) -> None:
    header = " ".join(f"{p:>8}" for p in REPLAY_POLICIES)
    label = "CPU tier" if tier == "cpu" else "store"
    width = 24 if tier == "cpu" else 36
    vs_best = " ".join(f"{p[:5] + ' vs':>9}" for p in judged(REPLAY_POLICIES))
    print(f"{'trace':{width}} {label:>9} {header} {vs_best}   (replayed {label} hit rate, %; "
          f"vs: each policy - max(lru, tinylfu), points)")
    for workload in workloads:
        name, sizes, found = results_for(tier, workload, REPLAY_POLICIES)
        for gib, results in zip(sizes, found, strict=True):
            print(matrix_row(name, gib, results), flush=True)


def print_slices(tier: str, draws: list[tuple[str, Callable[[int], Workload]]], seeds: list[int]) -> None:
    """The slice summary: each draw makes a workload from a seed (module docstring)."""
    label = "CPU tier" if tier == "cpu" else "store"
    header = " ".join(f"{p:>8}" for p in ONLINE)
    margins = " ".join(f"{p[:5] + ' worst':>18} {'mean':>7}" for p in judged(ONLINE))
    print(f"{'trace':36} {label:>9} {header} {margins}"
          f"   ({len(seeds)} slices: mean {label} hit rate, %; each policy - max(lru, tinylfu), points)")
    for _, draw in draws:
        per_seed = [results_for(tier, draw(seed), ONLINE) for seed in seeds]
        name, sizes = per_seed[0][0], per_seed[0][1]
        for i, gib in enumerate(sizes):
            print(slice_row(name, gib, seeds, [found[i] for _, _, found in per_seed]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversation", type=Path, default=CONFIGS / "mooncake_conversation_slice.jsonl")
    parser.add_argument("--synthetic", type=Path, default=CONFIGS / "mooncake_synthetic_slice.jsonl")
    parser.add_argument("--multi-turn", type=Path, default=CONFIGS / "multi_turn_8b.yaml")
    parser.add_argument("--turn-s", type=float, default=1.0, help="assumed service time of a turn (s)")
    parser.add_argument("--tier", choices=("cpu", "store"), default="cpu", help="the tier replayed")
    parser.add_argument("--slices", type=int, default=0, help="held-out slices per trace (0: one matrix)")
    parser.add_argument("--fraction", type=float, default=0.05, help="share of a trace's conversations in a slice")
    parser.add_argument("--seed", type=int, default=0, help="the first slice's seed")
    args = parser.parse_args()

    gpu = MOONCAKE_GPU_BYTES // TRACE_BLOCK_BYTES
    traces = [("mooncake conversation", read_trace(str(args.conversation), block_tokens=TRACE_BLOCK_TOKENS)),
              ("mooncake synthetic", read_trace(str(args.synthetic), block_tokens=TRACE_BLOCK_TOKENS))]

    def multi_turn(seed: int | None) -> Workload:
        return ("multi_turn_8b", *multi_turn_requests(args.multi_turn, args.turn_s, seed), ENGINE_BLOCK_BYTES)

    if not args.slices:
        workloads = [multi_turn(None)]
        workloads += [(name, mooncake_requests(lines), gpu, TRACE_BLOCK_BYTES) for name, lines in traces]
        print_matrix(args.tier, workloads)
        return

    def sampler(name: str, lines: list[TraceLine]) -> Callable[[int], Workload]:
        def draw(seed: int) -> Workload:
            sample = [request.line for request in select(lines, fraction=args.fraction, seed=seed)]
            return name, mooncake_requests(sample), gpu, TRACE_BLOCK_BYTES
        return draw

    draws = [("multi_turn_8b", multi_turn)] + [(name, sampler(name, lines)) for name, lines in traces]
    print_slices(args.tier, draws, list(range(args.seed, args.seed + args.slices)))


if __name__ == "__main__":
    main()
