"""Shared helpers of the GPU benchmarks: timing with CUDA events and the peaks they are
measured against (each benchmark measures its own peak in the same run)."""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from tieredkv import LLM, SamplingParams
from tieredkv.policy import CostModel

GiB = 1 << 30
# Llama-3-8B KV block: 32 layers, K and V, 16 tokens, 8 kv heads, head dim 128, bf16 (2 MiB)
LLAMA8B_BLOCK_SHAPE = (32, 2, 16, 8, 128)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU; none found", file=sys.stderr)
        sys.exit(1)


def time_cuda(fn: Callable[[], object], reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of `fn` over `reps` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def pinned_peaks(num_bytes: int = GiB) -> dict[str, float]:
    """GB/s of a pinned `copy_` each way, and of both at once on two streams."""
    host_a = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    d2h = num_bytes / time_cuda(lambda: host_a.copy_(dev_a, non_blocking=True), reps=5) / 1e9
    h2d = num_bytes / time_cuda(lambda: dev_b.copy_(host_b, non_blocking=True), reps=5) / 1e9
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        main = torch.cuda.current_stream()
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            host_a.copy_(dev_a, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_b.copy_(host_b, non_blocking=True)
        main.wait_stream(s1)
        main.wait_stream(s2)

    two_way = 2 * num_bytes / time_cuda(both, reps=5) / 1e9
    return {"d2h_peak_gbs": d2h, "h2d_peak_gbs": h2d, "two_way_peak_gbs": two_way}


def hbm_copy_peak(num_bytes: int = GiB) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    a = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * num_bytes / time_cuda(lambda: b.copy_(a)) / 1e9


def report(name: str, value: float, unit: str, peak: float | None = None, peak_name: str = "") -> dict:
    """Print one figure with its peak and ratio; return it as a record."""
    line = f"{name:<58} {value:10.2f} {unit}"
    if peak:
        line += f"   peak {peak:9.2f} {unit} ({peak_name})   ratio {value / peak:6.1%}"
    print(line, flush=True)
    return {"name": name, "value": value, "unit": unit, "peak": peak, "peak_name": peak_name}


def write_json(path: str | None, records: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


def start_redis_server(binary: str = "redis-server") -> tuple[subprocess.Popen, str]:
    """A fresh redis-server on a free loopback port (temp dir, no persistence); (process, URL).
    The caller terminates the process."""
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", tempfile.mkdtemp(), "--save", "",
            "--appendonly", "no", "--protected-mode", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{binary} did not start on port {port}")


FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def first_token_time(llm: LLM, prompt: list[int], cost: CostModel, keys: tuple[str, ...]) -> tuple[float, dict]:
    """TTFT of `prompt` on an engine with empty GPU and CPU prefix caches, planned under `cost`;
    and how much each of the stats `keys` moved meanwhile."""
    llm.reset_prefix_cache()
    llm.scheduler.policy = dataclasses.replace(llm.scheduler.policy, cost=cost)
    before = llm.stats()
    out = llm.generate(prompt, FIRST_TOKEN, use_tqdm=False)[0]
    after = llm.stats()
    return out.metrics.ttft, {k: after[k] - before[k] for k in keys}
