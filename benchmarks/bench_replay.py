"""The CPU tier's replacement policies replayed offline (CPU, no model, ~30 s): for each trace
and tier size, the CPU-tier hit rate (leading hit blocks of each request over the blocks asked
of the tier) under lru, tinylfu, adaptive (the default) and Belady's MIN with bypass.

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

    python benchmarks/bench_replay.py
    python benchmarks/bench_replay.py --synthetic /data/synthetic_trace.jsonl   # a full trace
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import yaml

from tieredkv.cache.trace import REPLAY_POLICIES, BlockTrace, replay, simulate
from tieredkv.experiment.traces import read_trace

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GiB = 1 << 30
ENGINE_BLOCK_BYTES = 2 << 20  # one 16-token block of llama-3-8b KV (bfloat16)
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash ids
TRACE_BLOCK_BYTES = ENGINE_BLOCK_BYTES * TRACE_BLOCK_TOKENS // 16
MOONCAKE_GPU_BYTES = 16 * GiB


def multi_turn_requests(config: Path, turn_s: float) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...]]], int]:
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


def mooncake_requests(path: Path) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every line's full 512-token blocks, in time order."""
    lines = sorted(read_trace(str(path), block_tokens=TRACE_BLOCK_TOKENS), key=lambda line: line.time_s)
    chains = [line.hash_ids[: line.input_length // TRACE_BLOCK_TOKENS] for line in lines]
    return [(chain, chain) for chain in chains]


def matrix_rows(name: str, trace: BlockTrace, block_bytes: int, tier_gib: tuple[int, ...]) -> list[str]:
    rows = []
    for gib in tier_gib:
        rates = {p: replay(trace, gib * GiB // block_bytes, p).hit_rate for p in REPLAY_POLICIES}
        margin = rates["adaptive"] - max(rates["lru"], rates["tinylfu"])
        cells = " ".join(f"{100 * rates[p]:8.1f}" for p in REPLAY_POLICIES)
        rows.append(f"{name:24} {gib:5} GiB {cells} {100 * margin:+9.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversation", type=Path, default=CONFIGS / "mooncake_conversation_slice.jsonl")
    parser.add_argument("--synthetic", type=Path, default=CONFIGS / "mooncake_synthetic_slice.jsonl")
    parser.add_argument("--multi-turn", type=Path, default=CONFIGS / "multi_turn_8b.yaml")
    parser.add_argument("--turn-s", type=float, default=1.0, help="assumed service time of a turn (s)")
    args = parser.parse_args()

    header = " ".join(f"{p:>8}" for p in REPLAY_POLICIES)
    print(f"{'trace':24} {'CPU tier':>9} {header} {'vs best':>9}   (replayed CPU-tier hit rate, %)")
    requests, gpu_blocks = multi_turn_requests(args.multi_turn, args.turn_s)
    for row in matrix_rows("multi_turn_8b", simulate(requests, gpu_blocks), ENGINE_BLOCK_BYTES, (4, 8, 16)):
        print(row, flush=True)
    gpu = MOONCAKE_GPU_BYTES // TRACE_BLOCK_BYTES
    for name, path in (("mooncake conversation", args.conversation), ("mooncake synthetic", args.synthetic)):
        trace = simulate(mooncake_requests(path), gpu)
        for row in matrix_rows(name, trace, TRACE_BLOCK_BYTES, (4, 16, 64)):
            print(row, flush=True)


if __name__ == "__main__":
    main()
