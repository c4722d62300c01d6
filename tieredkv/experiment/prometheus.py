"""Prometheus exposition of a running experiment (`tieredkv run CONFIG --prometheus-port PORT`)
and of the HTTP server (`tieredkv serve`, at its own /metrics).

Needs `prometheus-client` (`pip install prometheus-client`). Every number in the engine's
`stats()` becomes a gauge `tieredkv_<stat>{variant=...}`, and a stat holding a mapping (preemptions
by kind, ...) a gauge with a `kind` label; they are refreshed each time the run samples its
timeline (the server: at each scrape). The clients add `tieredkv_requests_total{variant,
outcome}` (ok, error, abort), `tieredkv_output_tokens_total` and histograms of TTFT and
inter-token latency. One exporter serves a whole invocation, every variant of a `--compare` run
under its own label; the server labels everything with its model name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PrometheusMetrics:
    """A registry of the engine's stats (gauges), the clients' latencies (histograms) and the
    requests and tokens they got (counters); `exposition()` is the text a scrape reads."""

    def __init__(self) -> None:
        try:
            import prometheus_client as prom
        except ImportError as err:
            raise ValueError("Prometheus metrics need prometheus-client: pip install 'tieredkv[prometheus]'") from err
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        self._gauges: dict[str, Any] = {}
        self.requests = prom.Counter("tieredkv_requests", "Requests finished, by outcome (ok or error)",
                                     ["variant", "outcome"], registry=self.registry)
        self.output_tokens = prom.Counter("tieredkv_output_tokens", "Tokens streamed to the clients",
                                          ["variant"], registry=self.registry)
        self.ttft = prom.Histogram("tieredkv_ttft_seconds", "Time to first token, seen by the client",
                                   ["variant"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.itl = prom.Histogram("tieredkv_itl_seconds", "Time between two streamed tokens, seen by the client",
                                  ["variant"], buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def update(self, variant: str, stats: Mapping[str, Any]) -> None:
        """Set a gauge for every number in `stats` (and every number of a mapping in it)."""
        for key, value in stats.items():
            if isinstance(value, Mapping):
                gauge = self._gauge(key, ("variant", "kind"))
                for kind, number in value.items():
                    if _is_number(number):
                        gauge.labels(variant, str(kind)).set(number)
            elif _is_number(value):
                self._gauge(key, ("variant",)).labels(variant).set(value)

    def record(self, variant: str, ttft_s: float | None, itls_s: list[float], tokens: int, error: bool,
               aborted: bool = False) -> None:
        """One finished request, as its client saw it (`aborted`: the client left early)."""
        self.requests.labels(variant, "abort" if aborted else "error" if error else "ok").inc()
        self.output_tokens.labels(variant).inc(tokens)
        if ttft_s is not None:
            self.ttft.labels(variant).observe(ttft_s)
        for itl in itls_s:
            self.itl.labels(variant).observe(itl)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST

    def _gauge(self, stat: str, labels: tuple[str, ...]) -> Any:
        if stat not in self._gauges:
            self._gauges[stat] = self._prom.Gauge(f"tieredkv_{stat}", f"engine stat '{stat}'", labels,
                                                  registry=self.registry)
        return self._gauges[stat]


class PrometheusExporter(PrometheusMetrics):
    """`PrometheusMetrics` served at /metrics over HTTP from a thread until `close()`."""

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        super().__init__()
        try:
            self._server, self._thread = self._prom.start_http_server(port, addr, registry=self.registry)
        except OSError as err:
            raise ValueError(f"--prometheus-port {port}: cannot listen on {addr}:{port} ({err})") from err

    @property
    def port(self) -> int:
        return self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
