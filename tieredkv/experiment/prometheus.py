"""Prometheus exposition of a running experiment (`tieredkv run CONFIG --prometheus-port PORT`)
and of the HTTP server (`tieredkv serve`, at its own /metrics).

Needs `prometheus-client` (`pip install prometheus-client`). Every number in the engine's
`stats()` becomes a gauge `tieredkv_<stat>{variant=...}`, and a stat holding a mapping (preemptions
by kind, ...) a gauge with a `kind` label; they are refreshed each time the run samples its
timeline (the server: at each scrape). The clients add `tieredkv_requests_total{variant,
outcome}` (ok, error, abort), `tieredkv_output_tokens_total` and histograms of TTFT and
inter-token latency. One exporter serves a whole invocation, every variant of a `--compare` run
under its own label; the server labels everything with its model name.

`ServerMetrics` (the server's) adds the series a vLLM Grafana dashboard reads, under vLLM's v1
names and its `model_name` label: the histograms `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:time_per_output_token_seconds` (per request),
`vllm:e2e_request_latency_seconds`; the gauges `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (the GPU tier's used blocks, 0 to 1);
the counters `vllm:prompt_tokens`, `vllm:generation_tokens`, `vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits` (prompt tokens, and those found cached in any tier) and
`vllm:request_success` (by `finished_reason`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tieredkv.experiment.metrics import RequestRecord

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets, so that a dashboard's quantiles read the same on both servers
VLLM_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0)
VLLM_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                      240.0, 480.0, 960.0, 1920.0, 7680.0)


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


class ServerMetrics(PrometheusMetrics):
    """`PrometheusMetrics` and the vLLM-named series of the HTTP server (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        prom, labels, reg = self._prom, ["model_name"], self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return prom.Histogram(f"vllm:{name}", doc, labels, buckets=buckets, registry=reg)

        def counter(name: str, doc: str) -> Any:
            return prom.Counter(f"vllm:{name}", doc, labels, registry=reg)

        def gauge(name: str, doc: str) -> Any:
            return prom.Gauge(f"vllm:{name}", doc, labels, registry=reg)

        self.vllm_ttft = histogram("time_to_first_token_seconds", "Time to first token", VLLM_TTFT_BUCKETS_S)
        self.vllm_itl = histogram("inter_token_latency_seconds", "Time between two outputs", VLLM_ITL_BUCKETS_S)
        self.vllm_tpot = histogram("time_per_output_token_seconds", "A request's (last - first token) / "
                                   "(outputs - 1)", VLLM_ITL_BUCKETS_S)
        self.vllm_e2e = histogram("e2e_request_latency_seconds", "Arrival to last token", VLLM_E2E_BUCKETS_S)
        self.vllm_prompt = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.vllm_generation = counter("generation_tokens", "Generated tokens (every sample)")
        self.vllm_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.vllm_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (any tier)")
        self.vllm_success = prom.Counter("vllm:request_success", "Finished requests by finish reason",
                                         ["model_name", "finished_reason"], registry=reg)
        self.vllm_running = gauge("num_requests_running", "Requests running")
        self.vllm_waiting = gauge("num_requests_waiting", "Requests waiting")
        self.vllm_kv_usage = gauge("kv_cache_usage_perc", "GPU-tier KV blocks held by requests (1 = 100%)")

    def update(self, variant: str, stats: Mapping[str, Any]) -> None:
        super().update(variant, stats)
        self.vllm_running.labels(variant).set(stats["requests_running"])
        self.vllm_waiting.labels(variant).set(stats["requests_waiting"])
        self.vllm_kv_usage.labels(variant).set(stats["gpu_blocks_used"] / max(stats["gpu_blocks_total"], 1))

    def observe(self, model: str, record: RequestRecord, generated: int, finish_reason: str | None) -> None:
        """One engine request the server saw end: its token times (one per output), prompt and
        cached tokens, tokens generated over its samples, and why it ended (None: it failed)."""
        self.record(model, record.ttft, record.itls, generated, finish_reason is None,
                    finish_reason == "abort")
        for histogram, value in ((self.vllm_ttft, record.ttft), (self.vllm_tpot, record.tpot),
                                 (self.vllm_e2e, record.e2el)):
            if value is not None:
                histogram.labels(model).observe(value)
        for itl in record.itls:
            self.vllm_itl.labels(model).observe(itl)
        self.vllm_prompt.labels(model).inc(record.prompt_tokens)
        self.vllm_generation.labels(model).inc(generated)
        self.vllm_queries.labels(model).inc(record.prompt_tokens)
        self.vllm_hits.labels(model).inc(record.cached_tokens)
        if finish_reason is not None:
            self.vllm_success.labels(model, finish_reason).inc()


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
