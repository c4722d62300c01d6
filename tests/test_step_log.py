"""`benchmarks/step_log.py`: every engine step of a real run, with the copies and store calls it made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "name": "exp",
    "model": "tiny-llama",
    # a GPU tier too small for the chats and a CPU tier smaller still: blocks are demoted, promoted and spilled
    "cache": {"block_size": 4, "num_gpu_blocks": 48, "cpu_cache_bytes": "64KiB", "nvme_path": "${results}/nvme",
              "nvme_bytes": "4MiB"},
    "scheduler": {"max_num_batched_tokens": 64},
    "workload": {"kind": "multi_turn", "users": 6, "turns": 4, "system_prompt_tokens": 64, "message_tokens": 16,
                 "max_tokens": 4},
}


def test_each_step_is_logged_with_the_copies_and_store_calls_it_made(tmp_path):
    config, out = tmp_path / "exp.yaml", tmp_path / "steps.json"
    config.write_text(yaml.safe_dump(CONFIG))
    command = [sys.executable, str(ROOT / "benchmarks" / "step_log.py"), str(out), "--", "run", str(config),
               "--no-progress", "--out", str(tmp_path / "results")]
    subprocess.run(command, check=True, capture_output=True, timeout=300, cwd=ROOT)
    log = json.loads(out.read_text())
    steps = [dict(zip(log["fields"], step, strict=True)) for step in log["steps"]]
    assert steps and all(s["ms"] >= s["host_ms"] >= s["launch_ms"] >= 0 for s in steps)
    jobs, dmas = sum(s["transfer_jobs"] for s in steps), sum(s["transfer_dmas"] for s in steps)
    assert jobs > 0 and dmas >= jobs  # each copy is at least one DMA
    assert all(s["transfer_submit_ms"] > 0 for s in steps if s["transfer_jobs"])
    assert all(s["transfer_submit_ms"] == 0 == s["transfer_dmas"] for s in steps if not s["transfer_jobs"])
    assert sum(s["store_submit_ms"] for s in steps) > 0  # the store was read or written
