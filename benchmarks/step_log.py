"""`tieredkv` with every engine step recorded: when it started, how long its forward pass and
sampling took, and what it ran. Written to a JSON list when the command ends.

    python benchmarks/step_log.py steps.json -- run configs/mooncake_synthetic_8b.yaml --sweep speed=8 \
        --variants gpu+cpu16 --no-progress

Each step is `[start_s, ms, prefill_tokens, prefill_seqs, decode_seqs, prefill_context_tokens,
longest_prefill_context, preempted]`: the prefill chunks' tokens, the sequences they belong to,
the decoding sequences, the tokens the chunks attend to before themselves (summed, and the
largest), and the sequences preempted to make room. It shows what a mean hides: whether decodes
ride in steps with prefill chunks, and how long those steps take at each chunk size and depth
(BENCHMARKS.md, "One schedule for every variant").
"""

from __future__ import annotations

import atexit
import json
import sys
import time

from tieredkv.cli import main
from tieredkv.engine import LLMEngine

STEPS: list[list[float]] = []
_forward = LLMEngine._forward


def _logged_forward(self: LLMEngine, batch, tables):
    prefill = seqs = decodes = context = longest = 0
    for item in batch.scheduled:
        seq = item.seq
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            decodes += 1
        else:
            prefill, seqs = prefill + item.num_new_tokens, seqs + 1
            context, longest = context + seq.num_computed_tokens, max(longest, seq.num_computed_tokens)
    start = time.perf_counter()
    news = _forward(self, batch, tables)
    STEPS.append([round(start, 4), round((time.perf_counter() - start) * 1e3, 2), prefill, seqs, decodes,
                  context, longest, len(batch.preempted)])
    return news


if __name__ == "__main__":
    if "--" not in sys.argv[2:]:
        raise SystemExit("usage: step_log.py OUT.json -- <tieredkv arguments>")
    out = sys.argv[1]
    LLMEngine._forward = _logged_forward
    atexit.register(lambda: json.dump(STEPS, open(out, "w")))
    args = sys.argv[sys.argv.index("--") + 1:]
    if args[:1] == ["run"] and "--in-process" not in args:
        args.insert(1, "--in-process")  # the engine this process patched, not one in a process of its own
    sys.exit(main(args))
