"""The prefill cost model is measured as serving runs prefill: a chunk at the start of a prompt
and the same chunk after a long cached context, whose difference is the attention term (timed
on whole short prompts, as before, the attention term came out 0 on an H100 at 2k-token steps,
so long prompts looked cheap to recompute)."""

from __future__ import annotations

import logging
import re

import pytest

from tieredkv import LLM
from tieredkv.calibrate import fit_chunks
from tieredkv.policy import CostModel


def test_fit_chunks_recovers_both_terms():
    a, b = 50e-6, 0.5e-9  # 50 us a token, 0.5 ns a (query, key) pair
    n, context = 2048, 32768
    t0 = a * n + b * n * n
    t1 = a * n + b * ((context + n) ** 2 - context**2)
    assert fit_chunks(n, context, t0, t1) == pytest.approx((a, b), rel=1e-9)


def test_fit_chunks_clamps_noise_to_non_negative_terms():
    assert fit_chunks(1024, 8192, 0.010, 0.009) == (0.010 / 1024, 0.0)  # the long chunk came out faster


def test_a_long_context_engine_times_a_chunk_after_it_and_sees_attention(tmp_path, monkeypatch, caplog):
    """A pool of 8k tokens, a model of 4k positions: the probe chunk (the step's 256 tokens) is
    timed after 0 and 3,840 cached tokens (the longest sequence less the chunk); attending to
    them costs, so the quadratic term is positive, and the cost model prices a 2k chunk late in
    a prompt above the same chunk early."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with caplog.at_level(logging.INFO, logger="tieredkv"), LLM(
        model="tiny-llama", block_size=16, num_gpu_blocks=512, cpu_cache_bytes="1MiB", preemption="auto",
        max_num_batched_tokens=256,
    ) as llm:
        cost: CostModel = llm.scheduler.policy.cost
    [line] = [r.getMessage() for r in caplog.records if r.name == "tieredkv.calibrate" and r.levelno == logging.INFO]
    assert re.search(r"ns/token\^2 \(a 256-token chunk after 0 and 3840 cached tokens\)", line), line
    assert cost.prefill_s_per_token_sq > 0
    assert cost.extend_s(2048, 2048) > cost.extend_s(0, 2048)


def test_every_tier_configuration_schedules_with_the_same_prefill_figures(tmp_path, monkeypatch, caplog):
    """`ttft` prices each prefill chunk by the cost model, so an engine with no tiers measures one
    too, and an engine with a store takes the prefill figures another engine of the model
    measured (only its disk is measured): a comparison of tier configurations then compares
    the tiers, not two schedules."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    common = {"model": "tiny-llama", "block_size": 16, "num_gpu_blocks": 512, "max_num_batched_tokens": 256}
    with caplog.at_level(logging.INFO, logger="tieredkv"):
        with LLM(**common, cpu_cache_bytes=0, preemption="recompute") as llm:
            alone: CostModel = llm.scheduler.policy.cost
        with LLM(**common, cpu_cache_bytes="1MiB", nvme_path=str(tmp_path / "kv"), nvme_bytes="1MiB",
                 io_backend="sync", preemption="auto") as llm:
            stored: CostModel = llm.scheduler.policy.cost
        with LLM(**common, cpu_cache_bytes=0, preemption="recompute", scheduling_policy="fcfs") as llm:
            assert llm.scheduler.policy.cost is None  # first come, first served prices nothing
    assert alone is not None and alone.prefill_s_per_token_sq > 0
    assert (stored.prefill_s_per_token, stored.prefill_s_per_token_sq) == (alone.prefill_s_per_token,
                                                                           alone.prefill_s_per_token_sq)
    assert stored.disk_read_bytes_per_s is not None
    lines = [r.getMessage() for r in caplog.records if r.name == "tieredkv.calibrate" and r.levelno == logging.INFO]
    assert len(lines) == 2 and "(cached)" in lines[1] and "disk reads" in lines[1], lines


def test_the_disk_is_measured_by_its_best_pass(tmp_path, monkeypatch):
    """A disk busy with other work for a moment reads slowly in one pass; the rate is cached, so
    the probe keeps the best of its passes, each reading at least DISK_PROBE_READS blocks (a
    real disk, timings replaced)."""
    from tieredkv import calibrate

    passes = iter([54e6, 2.1e9, 1.9e9])
    real = calibrate._timed_reads
    sizes = []

    def timed(fd, num_bytes, read_bytes, buffers, io):
        sizes.append((num_bytes, read_bytes, len(buffers)))
        real(fd, num_bytes, read_bytes, buffers, io)  # the real reads, through a backend of their own each pass
        return next(passes)

    monkeypatch.setattr(calibrate, "_timed_reads", timed)
    assert calibrate.measure_disk_read(str(tmp_path), num_bytes=8 << 20, read_bytes=1 << 20, queue_depth=4) == 2.1e9
    assert next(passes, None) is None  # every pass ran
    # each pass reads at least DISK_PROBE_READS blocks (8 MiB asked for, 1 MiB reads): one slow read is not the rate
    assert sizes == [(calibrate.DISK_PROBE_READS << 20, 1 << 20, 4)] * 3
