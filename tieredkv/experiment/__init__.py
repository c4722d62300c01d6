"""YAML-configured serving experiments (`tieredkv run`): the harness that drives AsyncLLM with
a workload and summarizes it (`harness.py`), seeded workloads, plots and a Prometheus exporter."""

from tieredkv.experiment.harness import run_experiment

__all__ = ["run_experiment"]
