"""The CPU tier's and the NVMe store's replacement policies replayed offline (CPU, no model,
~30 s each): for each trace and tier size, the tier's hit rate (leading hit blocks of each
request over the blocks asked of the tier) under lru, tinylfu, adaptive (the default) and
Belady's MIN with bypass.

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
own index (`tiers/nvme/slot_index.py`, chain parents from the requests). multi_turn_8b: a 4 GiB
CPU tier, stores of 4, 8 and 16 GiB; Mooncake: a 16 GiB CPU tier, stores of 16, 40 and 128 GiB.

    python benchmarks/bench_replay.py
    python benchmarks/bench_replay.py --tier store
    python benchmarks/bench_replay.py --synthetic /data/synthetic_trace.jsonl   # a full trace
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import yaml

from tieredkv.cache.trace import REPLAY_POLICIES, BlockTrace, ReplayPolicy, ReplayResult, replay, simulate
from tieredkv.experiment.traces import read_trace
from tieredkv.replacement import GhostTier, ReplacementPolicy, make_admission
from tieredkv.tiers.nvme.slot_index import Reservation, SlotIndex

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GiB = 1 << 30
ENGINE_BLOCK_BYTES = 2 << 20  # one 16-token block of llama-3-8b KV (bfloat16)
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash ids
TRACE_BLOCK_BYTES = ENGINE_BLOCK_BYTES * TRACE_BLOCK_TOKENS // 16
MOONCAKE_GPU_BYTES = 16 * GiB

Requests = list[tuple[tuple[int, ...], tuple[int, ...]]]


def multi_turn_requests(config: Path, turn_s: float) -> tuple[Requests, int]:
    """The multi-turn workload's requests as block chains, in time order, and the GPU blocks."""
    spec = yaml.safe_load(config.read_text())
    w, block = spec["workload"], spec["cache"]["block_size"]
    system = w["system_prompt_tokens"] // block
    rng = random.Random(w["seed"])
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


def mooncake_requests(path: Path) -> Requests:
    """Every line's full 512-token blocks, in time order."""
    lines = sorted(read_trace(str(path), block_tokens=TRACE_BLOCK_TOKENS), key=lambda line: line.time_s)
    chains = [line.hash_ids[: line.input_length // TRACE_BLOCK_TOKENS] for line in lines]
    return [(chain, chain) for chain in chains]


def matrix_rows(name: str, trace: BlockTrace, block_bytes: int, tier_gib: tuple[float, ...]) -> list[str]:
    rows = []
    for gib in tier_gib:
        rows.append(_row(name, gib, {p: replay(trace, int(gib * GiB) // block_bytes, p) for p in REPLAY_POLICIES}))
    return rows


def _row(name: str, gib: float, results: dict[ReplayPolicy, ReplayResult]) -> str:
    rates = {p: result.hit_rate for p, result in results.items()}
    margin = rates["adaptive"] - max(rates["lru"], rates["tinylfu"])
    cells = " ".join(f"{100 * rates[p]:8.1f}" for p in REPLAY_POLICIES)
    return f"{name:24} {gib:5g} GiB {cells} {100 * margin:+9.1f}"


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


def store_rows(
    name: str, requests: Requests, gpu_blocks: int, block_bytes: int, cpu_gib: int, store_gib: tuple[int, ...]
) -> list[str]:
    """The store's matrix rows below a CPU tier of `cpu_gib`, for stores of `store_gib`."""
    cpu_blocks = cpu_gib * GiB // block_bytes
    trace = store_trace(simulate(requests, gpu_blocks), cpu_blocks)
    parents = {child: parent for _, chain in requests for parent, child in zip(chain, chain[1:], strict=False)}
    rows = []
    for gib in store_gib:
        slots = gib * GiB // block_bytes
        results = {p: replay_store(trace, slots, p, parents) for p in ("lru", "tinylfu", "adaptive")}
        results["belady"] = replay(trace, slots, "belady")
        rows.append(_row(f"{name} (CPU {cpu_gib} GiB)", gib, results))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversation", type=Path, default=CONFIGS / "mooncake_conversation_slice.jsonl")
    parser.add_argument("--synthetic", type=Path, default=CONFIGS / "mooncake_synthetic_slice.jsonl")
    parser.add_argument("--multi-turn", type=Path, default=CONFIGS / "multi_turn_8b.yaml")
    parser.add_argument("--turn-s", type=float, default=1.0, help="assumed service time of a turn (s)")
    parser.add_argument("--tier", choices=("cpu", "store"), default="cpu", help="the tier replayed")
    args = parser.parse_args()

    header = " ".join(f"{p:>8}" for p in REPLAY_POLICIES)
    tier = "CPU tier" if args.tier == "cpu" else "store"
    width = 24 if args.tier == "cpu" else 36
    print(f"{'trace':{width}} {tier:>9} {header} {'vs best':>9}   (replayed {tier} hit rate, %)")
    requests, gpu_blocks = multi_turn_requests(args.multi_turn, args.turn_s)
    mooncake = [(name, mooncake_requests(path)) for name, path in
                (("mooncake conversation", args.conversation), ("mooncake synthetic", args.synthetic))]
    gpu = MOONCAKE_GPU_BYTES // TRACE_BLOCK_BYTES
    if args.tier == "store":
        rows = store_rows("multi_turn_8b", requests, gpu_blocks, ENGINE_BLOCK_BYTES, 4, (4, 8, 16))
        for name, chains in mooncake:
            rows += store_rows(name, chains, gpu, TRACE_BLOCK_BYTES, 16, (16, 40, 128))
    else:
        rows = matrix_rows("multi_turn_8b", simulate(requests, gpu_blocks), ENGINE_BLOCK_BYTES, (4, 8, 16))
        for name, chains in mooncake:
            rows += matrix_rows(name, simulate(chains, gpu), TRACE_BLOCK_BYTES, (4, 16, 64))
    for row in rows:
        print(row, flush=True)


if __name__ == "__main__":
    main()
