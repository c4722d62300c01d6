"""Load sweeps: each variant at each load point, and its goodput under the file's SLOs.

Operations:
- `sweep_document(experiment, done, failed) -> dict`: sweep.json: per variant, per load point the
  figures (vLLM's names), whether the SLOs held and, under per-request bounds, the share of
  requests within them and the requests per second within them; the variant's goodput (a point
  that failed holds no SLO).
- `goodput(points)`: the highest load at which the SLOs held, at it and at every lower point
  (a single lucky point above a failing one is noise, not capacity); None if none held.
- `format_sweep(doc)`: the table `tieredkv run --sweep` prints.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tieredkv.experiment.metrics import Summary
from tieredkv.experiment.slo import ATTAINMENT
from tieredkv.experiment.spec import Experiment, Run

SWEPT = ("request_throughput", "output_throughput", "p90_ttft_ms", "p99_ttft_ms", "median_ttft_ms",
         "median_tpot_ms", "p99_itl_ms", "p99_e2el_ms")
GOODPUT_RULE = "highest load point at which every SLO held, at it and at every lower point"


def goodput(points: list[dict[str, Any]]) -> float | None:
    """Highest `value` of the ascending `points` up to the first whose SLOs did not hold."""
    best = None
    for point in sorted(points, key=lambda p: p["value"]):
        if not point["slo_met"]:
            break
        best = point["value"]
    return best


def sweep_document(experiment: Experiment, done: list[tuple[Run, Summary, dict[str, Any]]],
                   failed: Collection[Run] = ()) -> dict[str, Any]:
    """sweep.json of the runs done (all of them, unless the sweep was interrupted) and of those
    that `failed` (no figures; their SLOs count as not met)."""
    assert experiment.sweep is not None, "a sweep document needs load points"
    key = experiment.sweep[0]
    finished = {id(run): (summary, result) for run, summary, result in done}
    failed_ids = {id(run) for run in failed}
    variants: dict[str, list[dict[str, Any]]] = {}
    for run in experiment.runs:  # in the order they ran (the file's)
        if id(run) in finished:
            point = _point(run, *finished[id(run)])
        elif id(run) in failed_ids:
            point = {"value": run.point[1], **dict.fromkeys(SWEPT), "slo_met": False if experiment.slo else None,
                     "slo_measured": None, "slo_attainment": None, "goodput_rps": None, "partial": False,
                     "errors": None, "failed": True, "result": None}
        else:  # not run: the sweep was interrupted
            continue
        variants.setdefault(run.variant or experiment.name, []).append(point)
    return {
        "schema_version": 1,
        "name": experiment.name,
        "key": key,
        "points": experiment.sweep[1],
        "slo": None if experiment.slo is None else experiment.slo.targets,
        "goodput_rule": GOODPUT_RULE,
        "variants": [{"name": name, "goodput": goodput(points) if experiment.slo is not None else None,
                      "points": points} for name, points in variants.items()],
    }


def _point(run: Run, summary: Summary, result: dict[str, Any]) -> dict[str, Any]:
    """A load point's entry in sweep.json, from its run's result."""
    slo = result["slo"]
    return {
        "value": run.point[1], **{k: result["metrics"][k] for k in SWEPT},
        "slo_met": None if slo is None else slo["met"],
        "slo_measured": None if slo is None else slo["measured"],
        "slo_attainment": None if slo is None else slo["measured"].get(ATTAINMENT),
        "goodput_rps": None if slo is None else slo.get("goodput_rps"),
        "partial": summary.partial, "errors": summary.errors, "failed": False,
        "result": f"{run.folder}/result.json",
    }


def format_sweep(doc: dict[str, Any]) -> str:
    """Per variant and load point: throughput, TTFT p90 / p99, ITL p99, SLO (and under
    per-request bounds the share of requests within them, and those per second); then goodput."""
    key = doc["key"]
    per_request = ATTAINMENT in (doc["slo"] or {})
    lines = [f"{'variant':<22}{key:>10}{'req/s':>9}{'out tok/s':>11}{'TTFT p90 ms':>13}{'TTFT p99 ms':>13}"
             f"{'ITL p99 ms':>12}{'SLO':>6}" + (f"{'within %':>10}{'good req/s':>12}" if per_request else "")]

    def cell(value: float | None, width: int, fmt: str = ".1f") -> str:
        return f"{'n/a' if value is None else format(value, fmt):>{width}}"

    for variant in doc["variants"]:
        for p in variant["points"]:
            slo = "n/a" if p["slo_met"] is None else "met" if p["slo_met"] else "miss"
            lines.append(f"{variant['name']:<22}{p['value']:>10g}{cell(p['request_throughput'], 9, '.2f')}"
                         f"{cell(p['output_throughput'], 11)}{cell(p['p90_ttft_ms'], 13)}{cell(p['p99_ttft_ms'], 13)}"
                         f"{cell(p['p99_itl_ms'], 12)}{slo:>6}"
                         + (f"{cell(_percent(p['slo_attainment']), 10)}{cell(p['goodput_rps'], 12, '.2f')}"
                            if per_request else "")
                         + ("  (partial)" if p["partial"] else "") + ("  (failed)" if p["failed"] else ""))
    if doc["slo"] is None:
        lines.append("goodput: n/a (the file has no slo: section)")
    else:
        targets = ", ".join(f"{k} <= {v:g}" for k, v in doc["slo"].items() if k != ATTAINMENT)
        rule = f" (met by {doc['slo'][ATTAINMENT]:.0%} of requests)" if per_request else ""
        lines.append(f"goodput ({key} under SLO {targets}{rule}):")
        for variant in doc["variants"]:
            value = variant["goodput"]
            lines.append(f"  {variant['name']:<20} {'none of the points' if value is None else f'{value:g}'}")
    return "\n".join(lines)


def _percent(share: float | None) -> float | None:
    return None if share is None else share * 100
