"""Run a YAML experiment: clients drive `AsyncLLM` as the workload says; record every request.

Operations:
- `run_experiment(path, out_dir)`: the run, or one run per entry of `variants:` (compare);
  writes `result.json` (and PNG plots) per variant under `out_dir/<name>/`; returns summaries.
- `summarize(name, records, elapsed_s, stats)` / `result_document(...)`: a run's `Summary` and
  result.json from its `RequestRecord`s (also used by benchmarks/bench_serving_peer.py).
- `format_summary(summary)` / `format_comparison(summaries)`: the tables `tieredkv run` prints.

A variant is a partial config merged over the base one, e.g.
    variants:
      - {name: recompute-only, cache: {cpu_cache_bytes: 0}, scheduler: {preemption: recompute}}
      - {name: gpu+cpu, cache: {nvme_path: null, nvme_bytes: 0}}
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm.auto import tqdm

from tieredkv.async_engine import AsyncLLM
from tieredkv.config import EXPERIMENT_SECTIONS, EngineConfig, read_yaml
from tieredkv.experiment.plots import write_plots
from tieredkv.experiment.prometheus import PrometheusExporter
from tieredkv.experiment.workloads import Workload, make_workload
from tieredkv.sampling import SamplingParams

TIMELINE_PERIOD_S = 0.05


@dataclass
class RequestRecord:
    """What one client saw (monotonic seconds)."""

    tag: str
    arrival: float
    returning: bool = False
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class Summary:
    """Figures of one run."""

    name: str
    requests: int
    errors: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    ttft_s: dict[str, float]
    ttft_returning_s: dict[str, float]
    itl_s: dict[str, float]
    stats: dict[str, Any]

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.stats.get("prefix_hit_tokens", 0) / self.prompt_tokens if self.prompt_tokens else 0.0


def _percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def summarize(name: str, records: list[RequestRecord], elapsed_s: float, stats: dict[str, Any]) -> Summary:
    """The figures of a run from what its clients recorded and the engine's `stats`."""
    ttfts = [r.ttft for r in records if r.ttft is not None]
    returning = [r.ttft for r in records if r.ttft is not None and r.returning]
    itls = [x for r in records for x in r.itls]
    return Summary(
        name=name, requests=len(records), errors=sum(r.error is not None for r in records),
        prompt_tokens=sum(r.prompt_tokens for r in records),
        output_tokens=sum(len(r.token_times) for r in records), elapsed_s=elapsed_s,
        ttft_s=_percentiles(ttfts), ttft_returning_s=_percentiles(returning), itl_s=_percentiles(itls),
        stats=stats,
    )


def result_document(name: str, config: dict[str, Any], workload: Workload, summary: Summary,
                    records: list[RequestRecord], start: float, timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """What result.json holds; times are seconds since `start` (the monotonic clock of the records)."""
    return {
        "name": name, "config": config, "workload": asdict(workload),
        "summary": {**asdict(summary), "output_tokens_per_s": summary.output_tokens_per_s},
        "requests": [{**asdict(r), "arrival": r.arrival - start, "ttft": r.ttft,
                      "token_times": [t - start for t in r.token_times]} for r in records],
        "timeline": timeline,
    }


class _Client:
    """Sends a workload's requests through AsyncLLM and records what it sees."""

    def __init__(self, llm: AsyncLLM, bar: tqdm, name: str, exporter: PrometheusExporter | None) -> None:
        self.llm, self.bar, self.name, self.exporter = llm, bar, name, exporter
        self.records: list[RequestRecord] = []

    async def request(self, prompt: list[int] | str, max_tokens: int, tag: str, returning: bool = False) -> list[int]:
        record = RequestRecord(tag, time.monotonic(), returning)
        self.records.append(record)
        tokens: list[int] = []
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        try:
            async for out in self.llm.generate_stream(prompt, params):
                record.token_times.append(time.monotonic())
                tokens = out.token_ids
                record.prompt_tokens = len(out.prompt_token_ids)
                record.cached_tokens = out.metrics.num_cached_tokens if out.metrics else 0
        except ValueError as err:
            record.error = str(err)
        self.bar.update(1)
        if self.exporter is not None:
            self.exporter.record(self.name, record.ttft, record.itls, len(record.token_times), record.error is not None)
        return tokens


async def _timeline(llm: AsyncLLM, start: float, samples: list[dict[str, Any]], stop: asyncio.Event,
                    publish: Callable[[dict[str, Any]], None] | None) -> None:
    keys = ("gpu_blocks_used", "cpu_blocks_used", "cpu_blocks_cached", "nvme_slots_used", "decode_tokens")
    while not stop.is_set():
        stats = llm.stats()
        if publish is not None:
            publish(stats)
        samples.append({"t": time.monotonic() - start, **{k: stats.get(k, 0) for k in keys}})
        try:
            await asyncio.wait_for(stop.wait(), TIMELINE_PERIOD_S)
        except TimeoutError:
            pass


async def _run(config: EngineConfig, workload: Workload, name: str, use_tqdm: bool,
               exporter: PrometheusExporter | None) -> tuple[Summary, dict]:
    llm = AsyncLLM(config=config)
    vocab = llm.engine.runner.model.config.vocab_size
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    with tqdm(total=workload.num_requests, desc=name, unit="req", disable=not use_tqdm) as bar:
        client = _Client(llm, bar, name, exporter)
        publish = None if exporter is None else lambda stats: exporter.update(name, stats)
        start = time.monotonic()
        sampler = asyncio.create_task(_timeline(llm, start, timeline, stop, publish))
        await workload.run(client, vocab)
        elapsed = time.monotonic() - start
        stop.set()
        await sampler
    stats = llm.stats()
    if publish is not None:
        publish(stats)
    await llm.close()
    summary = summarize(name, client.records, elapsed, stats)
    result = result_document(name, config.to_dict(), workload, summary, client.records, start, timeline)
    return summary, result


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def variants(doc: dict[str, Any], compare: bool) -> list[tuple[str, dict[str, Any]]]:
    """(name, engine config document) of each run: the base, or every listed variant."""
    base = {k: v for k, v in doc.items() if k not in EXPERIMENT_SECTIONS}
    name = str(doc.get("name", "experiment"))
    listed = doc.get("variants") or []
    if not compare:
        return [(name, base)]
    if not isinstance(listed, list) or not listed:
        raise ValueError("variants: --compare needs a list of variants in the YAML file")
    runs = []
    for i, variant in enumerate(listed):
        if not isinstance(variant, dict) or "name" not in variant:
            raise ValueError(f"variants[{i}]: expected a mapping with a 'name' and the keys it changes")
        override = {k: v for k, v in variant.items() if k != "name"}
        runs.append((f"{name}/{variant['name']}", _merge(base, override)))
    return runs


def run_experiment(
    path: str, out_dir: str = "results", compare: bool = False, use_tqdm: bool = True,
    on_summary: Callable[[Summary], None] | None = None, exporter: PrometheusExporter | None = None,
) -> list[Summary]:
    """Run the experiment (or each variant); `on_summary` sees each run's summary as it ends;
    `exporter` publishes the engine's stats and the clients' latencies while it runs."""
    doc = read_yaml(path)
    EngineConfig.from_dict(doc, extra_sections=EXPERIMENT_SECTIONS)  # the base must be valid on its own
    workload = make_workload(doc.get("workload") or {})
    summaries = []
    for name, engine_doc in variants(doc, compare):
        config = EngineConfig.from_dict(engine_doc)
        summary, result = asyncio.run(_run(config, workload, name, use_tqdm, exporter))
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        write_plots(result, folder)
        summaries.append(summary)
        if on_summary is not None:
            on_summary(summary)
    return summaries


def format_summary(s: Summary) -> str:
    preempt = s.stats.get("preemptions", {})
    nvme_choice = s.stats.get("nvme_prefix_blocks", {})
    rows = [
        ("requests", f"{s.requests} ({s.errors} errors), {s.requests_per_s:.2f} req/s"),
        ("prompt / output tokens", f"{s.prompt_tokens} / {s.output_tokens}"),
        ("elapsed", f"{s.elapsed_s:.2f} s"),
        ("output tokens/s", f"{s.output_tokens_per_s:.1f}"),
        ("TTFT p50 / p90 / p99", " / ".join(f"{v * 1e3:.1f}" for v in s.ttft_s.values()) + " ms"),
        ("  returning requests", " / ".join(f"{v * 1e3:.1f}" for v in s.ttft_returning_s.values()) + " ms"),
        ("ITL p50 / p90 / p99", " / ".join(f"{v * 1e3:.1f}" for v in s.itl_s.values()) + " ms"),
        ("prefix hit rate", f"{s.prefix_hit_rate:.1%} ({s.stats.get('prefix_hit_tokens', 0)} tokens)"),
        ("  from CPU / NVMe", f"{s.stats.get('cpu_hit_blocks', 0)} / {s.stats.get('nvme_loaded_blocks', 0)} blocks"),
        ("preemptions", ", ".join(f"{k} {v}" for k, v in preempt.items())),
        ("GPU blocks evicted", str(s.stats.get("gpu_evictions", 0))),
        ("moved D2H / H2D",
         f"{s.stats.get('bytes_d2h', 0) / 2**20:.1f} / {s.stats.get('bytes_h2d', 0) / 2**20:.1f} MiB"),
        ("compute waited on transfers", f"{s.stats.get('transfer_wait_s', 0.0):.3f} s"),
        ("spilled to NVMe", f"{s.stats.get('nvme_spilled_blocks', 0)} blocks"),
        ("NVMe prefix blocks: load / compute", f"{nvme_choice.get('load', 0)} / {nvme_choice.get('compute', 0)}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"== {s.name} =="] + [f"{k:<{width}}  {v}" for k, v in rows])


def format_comparison(summaries: list[Summary]) -> str:
    """Side by side, with each figure's ratio to the first variant's."""
    first = summaries[0]
    figures = [
        ("output tok/s", lambda s: s.output_tokens_per_s),
        ("TTFT p50 ms", lambda s: s.ttft_s["p50"] * 1e3),
        ("TTFT p99 ms", lambda s: s.ttft_s["p99"] * 1e3),
        ("return TTFT p50 ms", lambda s: s.ttft_returning_s["p50"] * 1e3),
        ("ITL p50 ms", lambda s: s.itl_s["p50"] * 1e3),
        ("prefix hit %", lambda s: s.prefix_hit_rate * 100),
    ]
    width = max(len(s.name) for s in summaries) + 2
    lines = [f"{'variant':<{width}}" + "".join(f"{name:>22}" for name, _ in figures)]
    for s in summaries:
        cells = []
        for _, get in figures:
            value, base = get(s), get(first)
            ratio = f"({value / base:.2f}x)" if base else ""
            cells.append(f"{value:>12.1f} {ratio:>9}")
        lines.append(f"{s.name:<{width}}" + "".join(cells))
    return "\n".join(lines)
