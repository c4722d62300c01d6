"""Two engines, one Redis tier: engine A (a process) serves the first turn of a workload and its
KV reaches the servers; engine B (another process) serves the returning requests from them.
Reported beside B alone (no remote tier) recomputing the same requests, as TTFT p50 and ratio.

For each model: `--requests` conversations, each a distinct `--prefix-tokens` prefix (a document,
a system prompt) followed by a 64-token question. Engine A answers each first question and
writes the prompt's blocks to the servers (as its demotions would have; `bench_remote_ttft`'s
helper). Then, one after another, in fresh processes:
  B remote  an engine with `remote_url` (its cost model measured at start-up: PCIe, prefill,
            the servers' read rate) answers each conversation's second question: the prefix is
            loaded, recomputed, or split between both, as its planner chooses;
  B alone   the same engine without a remote tier recomputes each prefix.
Each request runs alone (TTFT = time to its first token, one token generated). B's first tokens
must equal B alone's (greedy): the table says whether they do.

    python benchmarks/bench_remote_two_engines.py                      # llama-3-8b and llama-3-70b-8l, 16k
    python benchmarks/bench_remote_two_engines.py --servers 2 --prefix-tokens 32768 --json out.json
    python benchmarks/bench_remote_two_engines.py --models tiny-llama --device cpu --dtype float32 \\
        --prefix-tokens 256 --requests 3 --cpu-cache-bytes 64MiB      # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys

import redis
from bench_remote_ttft import write_prompt_blocks
from common import FIRST_TOKEN, require_cuda, start_redis_server, write_json

from tieredkv import LLM

QUESTION = 64
BLOCK_SIZE = 16


def conversations(args: argparse.Namespace, vocab_size: int, turn: int) -> list[list[int]]:
    """Each conversation's prompt at `turn` (0: A's, 1: B's): its prefix, then that turn's question."""
    prompts = []
    for i in range(args.requests):
        rng = random.Random(i)
        prefix = [rng.randrange(3, vocab_size) for _ in range(args.prefix_tokens)]
        question = random.Random(1000 * turn + i)
        prompts.append(prefix + [question.randrange(3, vocab_size) for _ in range(QUESTION)])
    return prompts


def engine(args: argparse.Namespace, model: str, urls: list[str] | None) -> LLM:
    blocks = -(-(args.prefix_tokens + QUESTION + 1) // BLOCK_SIZE)
    return LLM(model=model, device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE,
               num_gpu_blocks=blocks + 16, cpu_cache_bytes=args.cpu_cache_bytes,
               max_num_batched_tokens=min(16384, args.prefix_tokens + QUESTION), preemption="recompute",
               remote_url=urls)


def run_engine(args: argparse.Namespace) -> dict:
    """One engine process (`--role`): A writes, B (remote or alone) serves the second turn."""
    urls = None if args.role == "b-alone" else args.url
    with engine(args, args.model, urls) as llm:
        vocab_size = llm.runner.model.config.vocab_size
        warm = [random.Random(-1).randrange(3, vocab_size) for _ in range(BLOCK_SIZE * 4)]
        llm.generate(warm, FIRST_TOKEN, use_tqdm=False)  # kernels and allocator warmed up
        ttfts, tokens, stored = [], [], 0
        for prompt in conversations(args, vocab_size, turn=0 if args.role == "a" else 1):
            out = llm.generate(prompt, FIRST_TOKEN, use_tqdm=False)[0]
            ttfts.append(out.metrics.ttft)
            tokens.append(out.token_ids[0])
            if args.role == "a":
                stored += write_prompt_blocks(llm, prompt)
            llm.reset_prefix_cache()
        cost = llm.scheduler.policy.cost
        rate = cost.disk_read_bytes_per_s if cost is not None else None
    stats = llm.stats()
    return {"ttft_s": ttfts, "first_tokens": tokens, "blocks_stored": stored, "read_bytes_per_s": rate,
            **{k: stats.get(k, 0) for k in ("remote_hit_blocks", "remote_errors", "remote_bytes_read",
                                              "remote_read_busy_s", "remote_read_pipelines")}}


def spawn(args: argparse.Namespace, model: str, role: str, urls: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--models", model, "--url", *urls,
           "--device", args.device, "--dtype", args.dtype, "--cpu-cache-bytes", args.cpu_cache_bytes,
           "--prefix-tokens", str(args.prefix_tokens), "--requests", str(args.requests)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(args: argparse.Namespace, model: str, urls: list[str]) -> dict:
    """A, then B from the servers, then B alone, each its own process; one row of the table."""
    a = spawn(args, model, "a", urls)
    remote = spawn(args, model, "b-remote", urls)
    alone = spawn(args, model, "b-alone", urls)
    p50, p50_alone = statistics.median(remote["ttft_s"]), statistics.median(alone["ttft_s"])
    busy = remote["remote_read_busy_s"]
    return {"model": model, "prefix_tokens": args.prefix_tokens, "requests": args.requests, "servers": len(urls),
            "a_blocks_stored": a["blocks_stored"], "b_remote_ttft_p50_s": p50, "b_alone_ttft_p50_s": p50_alone,
            "speedup": p50_alone / p50, "b_remote_hit_blocks": remote["remote_hit_blocks"],
            "b_remote_errors": remote["remote_errors"],
            "b_read_gb_per_s": remote["remote_bytes_read"] / busy / 1e9 if busy else 0.0,
            "b_planned_read_gb_per_s": (remote["read_bytes_per_s"] or 0.0) / 1e9,
            "b_reads_per_pipeline": remote["remote_hit_blocks"] / max(1, remote["remote_read_pipelines"]),
            "first_tokens_equal": remote["first_tokens"] == alone["first_tokens"]}


def print_table(rows: list[dict]) -> None:
    head = (f"{'model':<16} {'prefix':>7} {'reqs':>4} {'srv':>3} {'B remote p50':>13} {'B alone p50':>12} "
            f"{'ratio':>6} {'hits':>7} {'errors':>6} {'read GB/s':>9} {'planned':>8} {'tokens':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<16} {r['prefix_tokens']:>7} {r['requests']:>4} {r['servers']:>3} "
              f"{r['b_remote_ttft_p50_s'] * 1e3:>10.1f} ms {r['b_alone_ttft_p50_s'] * 1e3:>9.1f} ms "
              f"{r['speedup']:>5.2f}x {r['b_remote_hit_blocks']:>7} {r['b_remote_errors']:>6} "
              f"{r['b_read_gb_per_s']:>9.2f} {r['b_planned_read_gb_per_s']:>8.2f} "
              f"{'equal' if r['first_tokens_equal'] else 'DIFFER':>7}")
    print("ratio: B alone's TTFT p50 over B's from the servers (> 1: the shared tier is faster); read GB/s: "
          "bytes B read over the seconds its reads were in flight; planned: the rate B's planner measured")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama-3-8b", "llama-3-70b-8l"])
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--requests", type=int, default=5, help="conversations (returning requests of B)")
    parser.add_argument("--servers", type=int, default=1, help="redis-servers to start (blocks spread over them)")
    parser.add_argument("--url", nargs="+", help="existing servers instead (one or more Redis URLs)")
    parser.add_argument("--device", default="cuda", help="cuda (the figures); cpu for a dry run of a tiny model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cpu-cache-bytes", default="10GiB", help="CPU tier (holds a prefix while it loads)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--role", choices=["a", "b-remote", "b-alone"], help=argparse.SUPPRESS)  # a child
    args = parser.parse_args()
    if args.device == "cuda":
        require_cuda()
    if args.role is not None:
        args.model = args.models[0]
        print(json.dumps(run_engine(args)), flush=True)
        return
    servers = [] if args.url else [start_redis_server() for _ in range(args.servers)]
    urls = args.url or [url for _, url in servers]
    try:
        rows = []
        for model in args.models:
            for _, url in servers:  # each model starts from empty servers
                redis.Redis.from_url(url).flushall()
            rows.append(compare(args, model, urls))
            print_table(rows)
        write_json(args.json, rows)
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
