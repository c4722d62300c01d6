"""The two-engine experiment end to end on a CPU: three real engine processes (A, B from the
servers, B alone) and two real redis-servers; B's first tokens equal B alone's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[1]


def test_two_engines_share_a_prefix_through_two_servers(tmp_path):
    require_redis_server()
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "benchmarks/bench_remote_two_engines.py", "--models", "tiny-llama", "--device", "cpu",
           "--dtype", "float32", "--prefix-tokens", "128", "--requests", "2", "--cpu-cache-bytes", "16MiB",
           "--servers", "2", "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["model"] == "tiny-llama" and row["servers"] == 2 and row["requests"] == 2
    assert row["a_blocks_stored"] == 2 * (128 + 64) // 16  # every full block of both prompts
    assert row["first_tokens_equal"] and row["b_remote_errors"] == 0
    assert row["speedup"] == row["b_alone_ttft_p50_s"] / row["b_remote_ttft_p50_s"]
    table = result.stdout.splitlines()
    assert any(line.startswith("tiny-llama") and line.rstrip().endswith("equal") for line in table)
