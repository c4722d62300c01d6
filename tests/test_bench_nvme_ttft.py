"""benchmarks/bench_nvme_ttft.py on the CPU: the load-only request's reads are timed through the
store and set beside the disk's O_DIRECT read peak, measured in the same directory."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from pathlib import Path

from tieredkv import LLM
from tieredkv.policy import CostModel

ROOT = Path(__file__).resolve().parents[1]
COST = CostModel(d2h_bytes_per_s=5e10, h2d_bytes_per_s=5e10, prefill_s_per_token=3e-5, disk_read_bytes_per_s=2e9)


def test_load_only_reads_are_timed_against_the_disk_peak(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_nvme_ttft")
    store_dir = tmp_path / "nvme"
    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=64, cpu_cache_bytes="64KiB", nvme_path=str(store_dir),
             nvme_bytes="4MiB", io_backend="sync", preemption="recompute",
             cost_model=dataclasses.asdict(COST)) as llm:
        prefix = list(range(10, 50))
        llm.generate(prefix + [5] * 4, bench.FIRST_TOKEN, use_tqdm=False)
        assert bench.spill_prompt_blocks(llm, prefix + [5] * 4) == 11
        store = llm.kv.offload.lower.store
        assert bench.store_queue_depth(store) == 32
        args = argparse.Namespace(dir=str(tmp_path), peak_bytes=8 << 20)
        load_only = dataclasses.replace(COST, prefill_s_per_token=1e3)
        reads = bench.load_only_read_rate(llm, prefix + [7] * 4, load_only, args)
        wrapped = {"submit_read", "submit_reads", "poll", "wait"}
        assert not wrapped & set(vars(store))  # the clock is off the store again
    assert reads["moved"]["nvme_loaded_blocks"] == 10  # the prefix's full blocks
    assert reads["bytes_read"] == 10 * llm.block_bytes and reads["block_bytes"] == llm.block_bytes  # KV bytes
    assert reads["queue_depth"] == 32 and reads["peak_read_gbs"] > 0
    assert 0 < reads["read_seconds"] < reads["ttft"]
    assert reads["restore_read_gbs"] == reads["bytes_read"] / reads["read_seconds"] / 1e9
    assert reads["restore_ttft_gbs"] < reads["restore_read_gbs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvme"]  # the peak's file is gone
