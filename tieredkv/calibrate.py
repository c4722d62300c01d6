"""Start-up calibration of the cost model: PCIe (or host memcpy) bandwidth each way, prefill
time as a function of length, and the NVMe tier's read bandwidth. Results are cached per device and model in
`$XDG_CACHE_HOME/tieredkv/cost_models.json`. A disk that cannot be measured (too little free
space beside the store for the probe file) gets a default read bandwidth and a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from tieredkv.policy import CostModel
from tieredkv.user_cache import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_DISK_READ_BYTES_PER_S = 2e9  # a mid-range NVMe drive: assumed where the disk cannot be measured


def cache_file() -> Path:
    return cache_dir() / "cost_models.json"


def _timed(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Best-of-`reps` seconds of `fn`, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, num_bytes: int = 64 << 20) -> tuple[float, float]:
    """(D2H, H2D) bytes/s between `device` and pinned host memory (host memcpy on the CPU)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device)
    return num_bytes / d2h, num_bytes / h2d


def measure_disk_read(directory: str, num_bytes: int = 64 << 20) -> float | None:
    """Bytes/s of large direct reads from a probe file written in `directory`; None, with a
    warning, where the probe cannot be written (less than twice its size free, or a write
    error): the caller then assumes DEFAULT_DISK_READ_BYTES_PER_S."""
    why = None
    try:
        free = shutil.disk_usage(directory).free
        if free < 2 * num_bytes:
            why = f"{free >> 20} MiB free, the probe needs {2 * num_bytes >> 20} MiB"
        else:
            return _probe_disk_read(directory, num_bytes)
    except OSError as err:
        why = f"writing the probe file failed: {err}"
    logger.warning(
        "cannot measure the disk under %s (%s); assuming it reads %.1f GB/s: pin "
        "scheduler.cost_model.disk_read_bytes_per_s to say otherwise",
        directory, why, DEFAULT_DISK_READ_BYTES_PER_S / 1e9,
    )
    return None


def _probe_disk_read(directory: str, num_bytes: int) -> float:
    """O_DIRECT where it works; otherwise the page cache is dropped for the file first."""
    path = os.path.join(directory, ".tieredkv-calibration")
    chunk = 4 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    try:
        with open(path, "wb") as f:
            for _ in range(num_bytes // chunk):
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            for offset in range(0, num_bytes, chunk):
                os.preadv(fd, [buf], offset)
            return num_bytes / (time.perf_counter() - start)
        finally:
            os.close(fd)
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.remove(path)


def fit_prefill(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """(a, b) with a*n + b*n^2 through both points, clamped to non-negative terms."""
    b = max(0.0, (t2 / n2 - t1 / n1) / (n2 - n1))
    a = max(0.0, t1 / n1 - b * n1)
    if a == 0.0 and b == 0.0:
        a = t2 / n2
    return a, b


def calibrate(
    key: str, device: torch.device, prefill: Callable[[int], None], max_tokens: int, disk_dir: str | None = None,
    bandwidth: Callable[[], tuple[float, float]] | None = None,
) -> CostModel:
    """The cost model for `key` (device + model [+ disk]), measured once and cached.
    `bandwidth` measures (D2H, H2D) bytes/s where `measure_bandwidth(device)` would not (the
    ranks of a tensor-parallel engine; `device` is then where `prefill` returns when done)."""
    if disk_dir is not None:
        key = f"{key}/disk:{os.path.abspath(disk_dir)}"
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        try:
            return CostModel(**cached[key])
        except (TypeError, ValueError):
            logger.warning("ignoring a damaged cost model cached in %s", path)
    d2h, h2d = bandwidth() if bandwidth is not None else measure_bandwidth(device)
    n2 = max(2, min(1024, max_tokens))
    n1 = max(1, n2 // 4)
    t1 = _timed(lambda: prefill(n1), device, reps=2)
    t2 = _timed(lambda: prefill(n2), device, reps=2)
    a, b = fit_prefill(n1, t1, n2, t2)
    disk = measure_disk_read(disk_dir) if disk_dir is not None else None
    if disk_dir is not None and disk is None:  # a guess: used now, not cached
        return CostModel(d2h, h2d, a, b, DEFAULT_DISK_READ_BYTES_PER_S)
    model = CostModel(d2h, h2d, a, b, disk)
    logger.info("calibrated %s: %s", key, model)
    cached[key] = asdict(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    except OSError as err:
        logger.warning("could not cache the cost model in %s: %s", path, err)
    return model
