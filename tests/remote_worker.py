"""An engine process for the remote-tier tests: `python -m tests.remote_worker URL ROUNDS`.

Runs the reference prompts ROUNDS times on an engine whose GPU and CPU tiers are too small for
them (so blocks go to the server and come back), dropping its own prefix caches between rounds,
and prints one JSON line: {"outputs": [[token ids per prompt] per round], "stats": engine stats}.
"""

from __future__ import annotations

import json
import sys

from tests.reference import make_prompts
from tieredkv import LLM, SamplingParams

NEW_TOKENS = 8
BLOCK_BYTES = 2048  # tiny-llama, block size 4, float32
# loading always beats recomputing (a calibrated tiny model on a CPU would recompute everything)
LOAD_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1e-3,
             "disk_read_bytes_per_s": 1e15}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def remote_llm(url: str | None, **kw) -> LLM:
    """GPU and CPU tiers so small that most prefixes end up on the remote server. The LRU CPU
    tier writes every block it demotes; the default frequency policy only those asked for again."""
    kw = {"cpu_policy": "lru", "scheduler": {"cost_model": LOAD_WINS}, **kw}
    return LLM(model="tiny-llama", block_size=4, num_gpu_blocks=30, cpu_cache_bytes=24 * BLOCK_BYTES,
               remote_url=url, preemption="recompute", **kw)


def prompts() -> list[list[int]]:
    return make_prompts(vocab_size=512)


def main(url: str, rounds: int) -> None:
    outputs = []
    with remote_llm(url) as llm:
        for _ in range(rounds):
            outputs.append([o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)])
            llm.reset_prefix_cache()
    # closed: the CPU blocks the server lacked were written at shutdown, and are counted
    stats = {k: v for k, v in llm.stats().items() if k.startswith("remote_")}
    print(json.dumps({"outputs": outputs, "stats": stats}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
