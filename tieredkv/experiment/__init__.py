"""YAML-configured serving experiments (`tieredkv run`): `spec` reads and checks a file,
`harness` drives AsyncLLM with its workload (`workloads`, `traces` for replayed traces such as
Mooncake's), `metrics` and `sweep` make the figures (latencies, SLOs, goodput), `results` and
`plots` write them, `prometheus` exports them while a run lasts."""

from tieredkv.experiment.harness import run_experiment

__all__ = ["run_experiment"]
