"""Service-level objectives: latency targets over all requests (`ttft_p90_ms: 2000`) or for each
request (`ttft_ms: 30000`, `slow_itl_ms: 100`, met by an `attainment` share of the requests),
what a run measured for them, whether they held, and goodput (requests per second that met
every per-request target). The latencies are `experiment/metrics.py`'s.

Operations:
- `Slo.from_dict(section)`: the `slo` section of an experiment spec, checked.
- `Slo.measure(records)` / `holds(measured, summary)` / `goodput_rps(records, elapsed_s)`;
  `report(records, summary)`: all of them, result.json's `slo`.
- `meets(record, bounds)`: whether one request met per-request bounds.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tieredkv.experiment.metrics import RequestRecord, Summary, latencies, percentile

_SLO_KEY = re.compile(r"^(ttft|tpot|itl|e2el|slow_itl)_(p\d+(?:\.\d+)?|mean|median)_ms$")
_REQUEST_KEY = re.compile(r"^(ttft|tpot|e2el|slow_itl)_ms$")  # a bound on each request's latency
ATTAINMENT = "attainment"  # the share of requests that must meet every per-request bound
DEFAULT_ATTAINMENT = 0.9


@dataclass(frozen=True)
class Slo:
    """Latency targets (milliseconds). Over all requests, `<latency>_<statistic>_ms`, e.g.
    `{"ttft_p90_ms": 2000, "itl_p99_ms": 100}`; for each request, `<latency>_ms`, e.g. Mooncake's
    `{"ttft_ms": 30000, "slow_itl_ms": 100}`: a request meets them when every one holds, and the
    run when at least `attainment` (default 0.9) of its requests do."""

    targets: dict[str, float]

    @classmethod
    def from_dict(cls, section: Any) -> Slo:
        if not isinstance(section, dict) or not section:
            raise ValueError("slo: expected a mapping of targets such as {ttft_p90_ms: 2000, itl_p99_ms: 100}")
        for key, value in section.items():
            if str(key) == ATTAINMENT:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                    raise ValueError(f"slo.attainment: expected the share of requests that must meet the "
                                     f"per-request targets, in (0, 1], got {value!r}")
                continue
            statistic = _SLO_KEY.match(str(key))
            if not statistic and not _REQUEST_KEY.match(str(key)):
                raise ValueError(
                    f"slo.{key}: not a target; write <latency>_<statistic>_ms with latency ttft, tpot, itl, e2el "
                    "or slow_itl and statistic p<N>, mean or median, e.g. ttft_p90_ms; or <latency>_ms for a bound "
                    "on each request (ttft, tpot, e2el or slow_itl), e.g. ttft_ms: 30000")
            if statistic and statistic[2].startswith("p") and float(statistic[2][1:]) > 100:
                raise ValueError(f"slo.{key}: a percentile is at most p100, got {statistic[2]}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"slo.{key}: expected milliseconds > 0, got {value!r}")
        targets = {str(k): float(v) for k, v in section.items()}
        if not any(_REQUEST_KEY.match(k) for k in targets):
            if ATTAINMENT in targets:
                raise ValueError("slo.attainment: counts requests that meet per-request targets, and there are "
                                 "none; add one such as ttft_ms: 30000 or slow_itl_ms: 100, or drop attainment")
            return cls(targets)
        return cls({**targets, ATTAINMENT: targets.get(ATTAINMENT, DEFAULT_ATTAINMENT)})

    @property
    def per_request(self) -> dict[str, float]:
        """The bounds on each request's latency (ms)."""
        return {k: v for k, v in self.targets.items() if _REQUEST_KEY.match(k)}

    def measure(self, records: list[RequestRecord]) -> dict[str, float | None]:
        """Each target's latency in this run (ms; None without samples); for a per-request bound,
        the share of requests within it, and for `attainment` the share within all of them."""
        measured: dict[str, float | None] = {}
        for key in self.targets:
            if key == ATTAINMENT:
                measured[key] = _share(records, lambda r: meets(r, self.per_request))
            elif _REQUEST_KEY.match(key):
                measured[key] = _share(records, lambda r, key=key: meets(r, {key: self.targets[key]}))
            else:
                measured[key] = _over_requests(key, records)
        return measured

    def holds(self, measured: dict[str, float | None], summary: Summary) -> bool:
        """Every target met, no request failed and the run was not cut short (a latency with no
        sample cannot show that it was met); per-request bounds hold through `attainment`."""
        if summary.errors or summary.partial:
            return False
        for key, target in self.targets.items():
            value = measured[key]
            if value is None or (key == ATTAINMENT and value < target) or (_SLO_KEY.match(key) and value > target):
                return False
        return True

    def goodput_rps(self, records: list[RequestRecord], elapsed_s: float) -> float | None:
        """Requests that met every per-request bound, per second of the run (None without
        per-request bounds, or for a run of no duration)."""
        if not self.per_request or not elapsed_s:
            return None
        return sum(meets(r, self.per_request) for r in records) / elapsed_s

    def report(self, records: list[RequestRecord], summary: Summary) -> dict[str, Any]:
        """The targets, what the run measured for them, whether they held, and goodput (requests
        per second within every per-request bound): result.json's `slo`."""
        measured = self.measure(records)
        return {"targets": self.targets, "measured": measured, "met": self.holds(measured, summary),
                "goodput_rps": self.goodput_rps(records, summary.elapsed_s)}


def meets(record: RequestRecord, bounds: dict[str, float]) -> bool:
    """Whether a request finished without error within every bound (ms, keys `<latency>_ms`);
    a one-token answer has no gaps, so no TPOT or slow ITL to miss."""
    if record.error is not None or not record.finished or not record.token_times:
        return False
    for key, bound_ms in bounds.items():
        value = getattr(record, _REQUEST_KEY.match(key).group(1))
        if value is not None and value * 1e3 > bound_ms:
            return False
    return True


def _share(records: list[RequestRecord], test: Callable[[RequestRecord], bool]) -> float | None:
    return sum(map(test, records)) / len(records) if records else None


def _over_requests(key: str, records: list[RequestRecord]) -> float | None:
    """An over-all-requests target's statistic in this run (ms; None without samples)."""
    kind, stat = _SLO_KEY.match(key).groups()
    ms = [v * 1e3 for v in latencies(records, kind)]
    if not ms:
        return None
    if stat == "mean":
        return statistics.fmean(ms)
    if stat == "median":
        return statistics.median(ms)
    return percentile(ms, float(stat[1:]))
