"""Run a YAML experiment: build the engine, drive its workload, summarise.

Operations:
- `run_experiment(path)`: the whole run; returns a `Summary`.
- `format_summary(summary)`: the table `tieredkv run` prints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from tieredkv.config import EXPERIMENT_SECTIONS, EngineConfig, read_yaml
from tieredkv.engine import LLMEngine
from tieredkv.outputs import RequestOutput
from tieredkv.sampling import SamplingParams
from tieredkv.workloads import make_workload


@dataclass
class Summary:
    """Figures of one run."""

    name: str
    requests: int
    errors: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    ttft_s: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.stats.get("prefix_hit_tokens", 0) / self.prompt_tokens if self.prompt_tokens else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def run_experiment(path: str, use_tqdm: bool = True) -> Summary:
    doc = read_yaml(path)
    config = EngineConfig.from_dict(doc, extra_sections=EXPERIMENT_SECTIONS)
    workload = make_workload(doc.get("workload") or {})
    engine = LLMEngine(config)
    conversations = workload.conversations(engine.runner.model.config.vocab_size)
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    outputs: list[RequestOutput] = []
    total = workload.users * workload.turns
    start = time.monotonic()
    with tqdm(total=total, desc=doc.get("name", "experiment"), unit="req", disable=not use_tqdm) as bar:
        for _ in range(workload.turns):
            ids = [engine.add_request(p, params) for p in conversations.next_prompts()]
            finished: dict[str, RequestOutput] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
            conversations.record_replies([finished[i].token_ids for i in ids])
            outputs += finished.values()
    elapsed = time.monotonic() - start
    return Summary(
        name=str(doc.get("name", path)),
        requests=len(outputs),
        errors=sum(o.error is not None for o in outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(o.token_ids) for o in outputs),
        elapsed_s=elapsed,
        ttft_s=[o.metrics.ttft for o in outputs if o.metrics and o.metrics.ttft is not None],
        stats=engine.stats(),
    )


def format_summary(s: Summary) -> str:
    preempt = s.stats.get("preemptions", {})
    rows = [
        ("requests", f"{s.requests} ({s.errors} errors)"),
        ("prompt / output tokens", f"{s.prompt_tokens} / {s.output_tokens}"),
        ("elapsed", f"{s.elapsed_s:.2f} s"),
        ("output tokens/s", f"{s.output_tokens_per_s:.1f}"),
        ("TTFT p50 / p99", f"{percentile(s.ttft_s, 50) * 1e3:.1f} / {percentile(s.ttft_s, 99) * 1e3:.1f} ms"),
        ("prefix hit rate", f"{s.prefix_hit_rate:.1%} ({s.stats.get('prefix_hit_tokens', 0)} tokens)"),
        ("  from CPU / NVMe", f"{s.stats.get('cpu_hit_blocks', 0)} / {s.stats.get('nvme_loaded_blocks', 0)} blocks"),
        ("preemptions", ", ".join(f"{k} {v}" for k, v in preempt.items())),
        ("GPU blocks evicted", str(s.stats.get("gpu_evictions", 0))),
        ("moved D2H / H2D", f"{s.stats.get('bytes_d2h', 0) / 2**20:.1f} / {s.stats.get('bytes_h2d', 0) / 2**20:.1f} MiB"),
        ("spilled to NVMe", f"{s.stats.get('nvme_spilled_blocks', 0)} blocks"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"== {s.name} =="] + [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
