"""What a run's clients saw, and the figures made of it.

Operations:
- `RequestRecord`: one request as its client saw it (monotonic seconds).
- `summarize(name, records, elapsed_s, stats) -> Summary`: a run's figures.
- `ttft_split_figures(records)`: the TTFT split by phase over a run's requests (mean and
  percentiles of each phase, and the least share of a request's TTFT the phases account for).
- `serving_metrics(summary, records)`: the figures under the names `vllm bench serve` gives
  them (`mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p90_ttft_ms`, `p99_ttft_ms`, and the
  same for `tpot`, `itl` and `e2el`; `request_throughput`, `output_throughput`, ...).
- `slowest_mean`, `percentile(s)`, `latencies(records, kind)`: the statistics the figures
  (and the SLO verdict, `experiment/slo.py`) are made of.
- `format_summary(summary)` / `format_comparison(summaries)`: the tables `tieredkv run` prints;
  a figure with no sample (no returning request, say) prints n/a.

Latencies, as vLLM defines them: TTFT from the request's sending to its first token; ITL the
gaps between tokens; TPOT a request's (last token - first token) / (output tokens - 1); E2EL
from sending to the last token; slow ITL the mean of a request's slowest 10% of token gaps
(Mooncake's TBT: a stream that stalls now and then misses it even when its median gap is low).
The prefix hit rate counts the tokens of the clients' prompts
that were found cached when the request was first admitted (`cached_tokens`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el", "slow_itl")
SLOW_ITL_FRACTION = 0.1  # slow ITL: the mean of this share of a request's gaps, the slowest


@dataclass
class RequestRecord:
    """What one client saw (monotonic seconds). `finished`: its stream ended (not cut short by
    an interrupted run); `cached_tokens`: prompt tokens found cached at its first admission;
    `ttft_split`: the engine's seconds of its TTFT by phase (`tieredkv.sequence.TtftSplit`);
    `engine_first_token`: when the engine had its first token (the same clock: one machine);
    `restart_wait`: seconds it waited to be sent while a warm restart was under way (None: it
    was sent at once)."""

    tag: str
    arrival: float
    returning: bool = False
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    finished: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    ttft_split: dict[str, float] | None = None
    engine_first_token: float | None = None
    restart_wait: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def ttft_phases(self) -> dict[str, float] | None:
        """The TTFT by phase: `restart` where it waited to be sent across a warm restart
        (`restart_wait`), the engine's (`ttft_split`, from the front end's arrival stamp to the
        engine's first token), `delivery` (from then until the client had the token: the
        outputs' way back, measured) and `client`, the rest (before the front end stamped the
        arrival); they sum to `ttft`."""
        if self.ttft_split is None or self.ttft is None or self.engine_first_token is None:
            return None
        restart = {} if self.restart_wait is None else {"restart": self.restart_wait}
        delivery = self.token_times[0] - self.engine_first_token
        measured = sum(self.ttft_split.values()) + delivery + (self.restart_wait or 0.0)
        return {**restart, **self.ttft_split, "delivery": delivery, "client": self.ttft - measured}

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2el(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    @property
    def slow_itl(self) -> float | None:
        """The mean of the slowest `SLOW_ITL_FRACTION` of this request's gaps (None for no gap)."""
        return slowest_mean(self.itls, SLOW_ITL_FRACTION)


def slowest_mean(values: list[float], fraction: float) -> float | None:
    """The mean of the largest `fraction` of `values`, at least one of them (None for none):
    of 25 gaps, the 3 slowest (ceil(2.5))."""
    if not values:
        return None
    k = max(1, math.ceil(fraction * len(values) - 1e-9))
    return statistics.fmean(sorted(values, reverse=True)[:k])


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 of `values` (None for none)."""
    return {f"p{q}": percentile(values, q) for q in PERCENTILES}


def latencies(records: list[RequestRecord], kind: str) -> list[float]:
    """Every sample of one latency (`ttft`, `tpot`, `itl`, `e2el`) in seconds."""
    if kind == "itl":
        return [x for r in records for x in r.itls]
    values = (getattr(r, kind) for r in records if r.error is None)
    return [v for v in values if v is not None]


@dataclass
class Summary:
    """Figures of one run (seconds; a percentile of no samples is None)."""

    name: str
    requests: int
    errors: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    ttft_s: dict[str, float | None]
    ttft_returning_s: dict[str, float | None]
    itl_s: dict[str, float | None]
    stats: dict[str, Any]
    tpot_s: dict[str, float | None] = field(default_factory=dict)
    e2el_s: dict[str, float | None] = field(default_factory=dict)
    cached_tokens: int = 0
    partial: bool = False
    restart: dict[str, Any] | None = None  # a warm restart's figures (experiment/restart.py)
    ttft_split_s: dict[str, Any] = field(default_factory=dict)  # `ttft_split_figures`

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens found cached at first admission, over all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def summarize(name: str, records: list[RequestRecord], elapsed_s: float, stats: dict[str, Any],
              partial: bool = False, restart: dict[str, Any] | None = None) -> Summary:
    """The figures of a run from what its clients recorded and the engine's `stats` (after a
    restart: the new engine's; `restart` holds the restart's own figures)."""
    ok = [r for r in records if r.error is None]
    return Summary(
        name=name, requests=len(records), errors=len(records) - len(ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=sum(len(r.token_times) for r in records), elapsed_s=elapsed_s,
        ttft_s=percentiles(latencies(records, "ttft")),
        ttft_returning_s=percentiles(latencies([r for r in records if r.returning], "ttft")),
        itl_s=percentiles(latencies(records, "itl")), stats=stats,
        tpot_s=percentiles(latencies(records, "tpot")), e2el_s=percentiles(latencies(records, "e2el")),
        cached_tokens=sum(r.cached_tokens for r in ok), partial=partial, restart=restart,
        ttft_split_s=ttft_split_figures(ok),
    )


def ttft_split_figures(records: list[RequestRecord]) -> dict[str, Any]:
    """Over the requests with a TTFT split: each phase's mean and p50 / p90 / p99 (seconds,
    `RequestRecord.ttft_phases`; a phase some requests lack, `restart`, counts 0 for them), and
    `accounted`: the least share of a request's TTFT that the measured phases (the engine's,
    `delivery`, `restart`) sum to (the rest is `client`). Empty without splits."""
    split = [(r, r.ttft_phases) for r in records if r.ttft_phases is not None and r.ttft]
    if not split:
        return {}
    names = list(dict.fromkeys(k for _, p in split for k in p))  # in their order, `restart` first
    names.sort(key=lambda k: k != "restart")
    phases = {k: [p.get(k, 0.0) for _, p in split] for k in names}
    figures: dict[str, Any] = {k: {"mean": statistics.fmean(v), **percentiles(v)} for k, v in phases.items()}
    figures["accounted"] = min(1 - p["client"] / r.ttft for r, p in split)
    return figures


def serving_metrics(summary: Summary, records: list[RequestRecord]) -> dict[str, float | int | None]:
    """The run's figures under `vllm bench serve`'s names (milliseconds, tokens per second)."""
    elapsed = summary.elapsed_s or None
    out: dict[str, float | int | None] = {
        "duration": summary.elapsed_s,
        "completed": sum(r.finished and r.error is None for r in records),
        "failed": summary.errors,
        "total_input_tokens": summary.prompt_tokens,
        "total_output_tokens": summary.output_tokens,
        "request_throughput": summary.requests / elapsed if elapsed else None,
        "output_throughput": summary.output_tokens / elapsed if elapsed else None,
        "total_token_throughput": (summary.prompt_tokens + summary.output_tokens) / elapsed if elapsed else None,
    }
    for kind in LATENCIES:
        ms = [v * 1e3 for v in latencies(records, kind)]
        out[f"mean_{kind}_ms"] = statistics.fmean(ms) if ms else None
        out[f"median_{kind}_ms"] = statistics.median(ms) if ms else None
        out[f"std_{kind}_ms"] = statistics.pstdev(ms) if ms else None
        for q in PERCENTILES:
            out[f"p{q}_{kind}_ms"] = percentile(ms, q)
    return out


# ---------------------------------------------------------------------------- tables


def _ms(values: dict[str, float | None]) -> str:
    if not values or all(v is None for v in values.values()):
        return "n/a"
    return " / ".join("n/a" if v is None else f"{v * 1e3:.1f}" for v in values.values()) + " ms"


def format_summary(s: Summary) -> str:
    preempt = s.stats.get("preemptions", {})
    nvme_choice = s.stats.get("nvme_prefix_blocks", {})
    late = s.stats.get("nvme_late_requests", {})
    tokens = s.stats.get("preempted_tokens", {})  # the computed tokens each kind of preemption held
    held = s.stats.get("held_back", {})
    lent = ""
    if "nvme_staging_lent" in s.stats:  # what swap-outs took from the tier below's holds
        dropped = s.stats.get("nvme_plans_dropped_for_swaps", 0)
        lent = f"; {s.stats['nvme_staging_lent']} staging blocks lent and {dropped} load plans dropped for swaps"
    hit = "n/a" if s.prefix_hit_rate is None else f"{s.prefix_hit_rate:.1%} ({s.cached_tokens} tokens)"
    rows = [
        ("requests", f"{s.requests} ({s.errors} errors), {s.requests_per_s:.2f} req/s"
         + (" [interrupted: partial]" if s.partial else "")),
        ("prompt / output tokens", f"{s.prompt_tokens} / {s.output_tokens}"),
        ("elapsed", f"{s.elapsed_s:.2f} s"),
        ("output tokens/s", f"{s.output_tokens_per_s:.1f}"),
        ("TTFT p50 / p90 / p99", _ms(s.ttft_s)),
        ("  returning requests", _ms(s.ttft_returning_s)),
        ("TPOT p50 / p90 / p99", _ms(s.tpot_s)),
        ("ITL p50 / p90 / p99", _ms(s.itl_s)),
        ("E2EL p50 / p90 / p99", _ms(s.e2el_s)),
        _split_row(s.ttft_split_s),
        ("prefix hit rate", hit),
        ("  from GPU / CPU tier", f"{s.stats.get('gpu_hit_blocks', 0)} / {s.stats.get('cpu_hit_blocks', 0)} blocks "
                                  f"({s.stats.get('nvme_loaded_blocks', 0)} read into the CPU tier from below)"),
        ("preemptions", ", ".join(f"{k} {v}" for k, v in preempt.items())
         + (f" ({' / '.join(f'{k} {v}' for k, v in tokens.items())} tokens"
            f"; {s.stats.get('recomputed_for_cpu_room', 0)} recomputed for want of CPU room{lent})" if tokens else "")),
        ("prompts held back (sequence steps)", ", ".join(f"{k} {v}" for k, v in held.items()) or "none"),
        ("GPU blocks evicted", str(s.stats.get("gpu_evictions", 0))),
        ("moved D2H / H2D",
         f"{s.stats.get('bytes_d2h', 0) / 2**20:.1f} / {s.stats.get('bytes_h2d', 0) / 2**20:.1f} MiB"),
        ("compute waited on transfers", f"{s.stats.get('transfer_wait_s', 0.0):.3f} s"),
        ("transfer jobs D2H / H2D: started, host ms a job", _jobs_row(s.stats)),
        ("CPU demotions: kept / turned down",
         f"{s.stats.get('cpu_demoted_blocks', 0)} / {s.stats.get('cpu_rejected_blocks', 0)} "
         f"({s.stats.get('nvme_staged_blocks', 0)} staged for the tier below, "
         f"{s.stats.get('cpu_demotions_on_disk', 0)} on it already)"),
        ("spilled to NVMe", f"{s.stats.get('nvme_spilled_blocks', 0)} blocks "
                            f"({s.stats.get('nvme_write_skipped_blocks', 0)} on disk already, "
                            f"{s.stats.get('nvme_staged_waited', 0)} staged ones waited for it, "
                            f"{s.stats.get('nvme_spills_dropped', 0)} dropped, "
                            f"{s.stats.get('nvme_write_backlog', 0)} queued at the end)"),
        ("NVMe prefix blocks: load / compute", f"{nvme_choice.get('load', 0)} / {nvme_choice.get('compute', 0)} "
                                               f"({nvme_choice.get('compute_for_queues', 0)} for the queues)"),
        ("  loads found late, computed", f"{s.stats.get('nvme_late_loads', 0)} blocks (by {late.get('waiting', 0)} "
                                         f"waiting, {late.get('running', 0)} running requests)"),
        ("steps waiting on NVMe loads", str(s.stats.get("nvme_load_waits", 0))),
        _loop_row(s.stats),
        ("disk read observed", f"{s.stats['disk_read_bytes_per_s'] / 1e9:.2f} GB/s"
         if "disk_read_bytes_per_s" in s.stats else "n/a"),
        *_restart_rows(s),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"== {s.name} =="] + [f"{k:<{width}}  {v}" for k, v in rows])


def _jobs_row(stats: dict[str, Any]) -> str:
    """Each direction's jobs and the engine loop's mean time to submit one."""
    parts = []
    for kind in ("d2h", "h2d"):
        jobs = stats.get(f"transfer_jobs_{kind}", 0)
        host_ms = 1e3 * stats.get(f"transfer_submit_{kind}_s", 0.0) / max(jobs, 1)
        parts.append(f"{jobs}, {host_ms:.3f}")
    return " / ".join(parts)


def _split_row(figures: dict[str, Any]) -> tuple[str, str]:
    """The TTFT split's means by phase (the engine's `TtftSplit` phases, in its order)."""
    phases = [k for k in figures if k != "accounted"]
    if not phases:
        return "TTFT split mean", "n/a"
    means = " / ".join(f"{figures[k]['mean'] * 1e3:.1f}" for k in phases)
    return (f"TTFT mean: {' / '.join(phases)}",
            f"{means} ms ({figures['accounted']:.1%} of each TTFT at least)")


def _loop_row(stats: dict[str, Any]) -> tuple[str, str]:
    """Where the engine loop's time went (its `loop_*_s` stats)."""
    keys = [k for k in stats if k.startswith("loop_") and k.endswith("_s")]
    if not keys:
        return "engine loop", "n/a"
    longest = f"; longest step {stats['longest_step_s'] * 1e3:,.0f} ms" if "longest_step_s" in stats else ""
    if stats.get("launch_s_fixed") or stats.get("launch_s_per_token"):  # learned on a GPU
        longest += (f"; launch {stats['launch_s_fixed'] * 1e3:.2f} ms"
                    f" + {stats['launch_s_per_token'] * 1e6:.2f} us a token")
    if stats.get("decode_steps"):  # a decode-only step is the gap between two tokens
        n = stats["decode_steps"]
        longest += (f"; {n} decode-only steps, {stats['decode_step_host_s'] / n * 1e3:.2f} ms before"
                    f" the launch ({stats.get('decode_step_schedule_s', 0.0) / n * 1e3:.2f} scheduling)"
                    f" of {stats['decode_step_s'] / n * 1e3:.2f} ms each")
    if "gc_pause_s" in stats:
        longest += (f"; GC {stats['gc_pause_s']:.2f} s ({stats['gc_full_collections']} full,"
                    f" longest {stats['gc_longest_pause_s'] * 1e3:,.0f} ms)")
    return (f"engine loop: {' / '.join(k[5:-2] for k in keys)}",
            " / ".join(f"{stats[k]:.2f}" for k in keys) + " s" + longest)


def _restart_rows(s: Summary) -> list[tuple[str, str]]:
    r = s.restart
    if r is None:
        return []
    if not r["happened"]:
        return [("restart", f"none: the workload ended before {r['after_s']:g} s")]
    p50 = {k: r[f"returning_ttft_{k}_s"]["p50"] for k in ("before", "after", "after_all")}
    return [
        ("restart", f"at {r['began_s']:.1f} s, store {r['store']}: engine down {r['downtime_s']:.2f} s (closing "
                    f"{r['closed_s'] - r['began_s']:.2f}, emptying the store {r['opening_s'] - r['closed_s']:.2f}, "
                    f"opening {r['ready_s'] - r['opening_s']:.2f}), {r['drained_requests']} requests drained, "
                    f"{r['waited_requests']} waited"),
        ("  returning TTFT p50 before", f"{_ms({'p50': p50['before']})} ({r['returning_before']} requests)"),
        ("  first return after", f"{_ms({'p50': p50['after']})} ({r['returning_after']} conversations)"),
        ("  every return after", f"{_ms({'p50': p50['after_all']})} ({r['returning_after_all']} requests)"),
        ("  new engine: NVMe restored / loaded", f"{s.stats.get('nvme_restored', 0)} / "
                                                 f"{s.stats.get('nvme_loaded_blocks', 0)} blocks"),
    ]


def _scaled(get: Callable[[Summary], float | None], scale: float) -> Callable[[Summary], float | None]:
    def value(s: Summary) -> float | None:
        v = get(s)
        return None if v is None else v * scale

    return value


COMPARED: list[tuple[str, Callable[[Summary], float | None]]] = [
    ("output tok/s", lambda s: s.output_tokens_per_s),
    ("TTFT p50 ms", _scaled(lambda s: s.ttft_s["p50"], 1e3)),
    ("TTFT p99 ms", _scaled(lambda s: s.ttft_s["p99"], 1e3)),
    ("return TTFT p50 ms", _scaled(lambda s: s.ttft_returning_s["p50"], 1e3)),
    ("ITL p50 ms", _scaled(lambda s: s.itl_s["p50"], 1e3)),
    ("prefix hit %", _scaled(lambda s: s.prefix_hit_rate, 100)),
]


def _after_restart(s: Summary) -> float | None:
    happened = s.restart is not None and s.restart["happened"]
    return s.restart["returning_ttft_after_s"]["p50"] * 1e3 if happened and s.restart["returning_after"] else None


# the first return of each conversation after a warm restart, TTFT p50 (with a variant that restarts)
RESTART_COMPARED = ("restart return p50 ms", _after_restart)


def compared(summaries: list[Summary]) -> list[tuple[str, Callable[[Summary], float | None]]]:
    """The figures compared side by side: COMPARED, and the restart's where a variant restarts."""
    restarts = any(s.restart is not None for s in summaries)
    return [*COMPARED, RESTART_COMPARED] if restarts else COMPARED


def comparison_rows(summaries: list[Summary]) -> list[dict[str, Any]]:
    """Per variant, each compared figure and its ratio to the first variant's (None: n/a)."""
    first = summaries[0]
    rows = []
    for s in summaries:
        cells = {}
        for name, get in compared(summaries):
            value, base = get(s), get(first)
            cells[name] = {"value": value, "ratio": value / base if value is not None and base else None}
        rows.append({"name": s.name, "figures": cells})
    return rows


def format_comparison(summaries: list[Summary]) -> str:
    """Side by side, with each figure's ratio to the first variant's."""
    width = max(len(s.name) for s in summaries) + 2
    lines = [f"{'variant':<{width}}" + "".join(f"{name:>22}" for name, _ in compared(summaries))]
    for row in comparison_rows(summaries):
        cells = []
        for cell in row["figures"].values():
            value = "n/a" if cell["value"] is None else f"{cell['value']:.1f}"
            ratio = "" if cell["ratio"] is None else f"({cell['ratio']:.2f}x)"
            cells.append(f"{value:>12} {ratio:>9}")
        lines.append(f"{row['name']:<{width}}" + "".join(cells))
    return "\n".join(lines)
