"""Start-up calibration of the cost model: PCIe (or host memcpy) bandwidth each way, prefill
time as a function of length, and the NVMe tier's read bandwidth (through the store's own
path: its backend, read size and queue depth; the scheduler corrects it online). Results are
cached in `$XDG_CACHE_HOME/tieredkv/cost_models.json`: the copies and prefill per device and
model, the read rate per disk, so every engine of a model takes the same prefill figures
(an engine with a store as one without), whichever measured them first. A disk that cannot
be measured (too little free space beside the store for the probe file) gets a default read
bandwidth and a warning.
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
from dataclasses import asdict, replace
from pathlib import Path
from typing import NamedTuple

import torch

from tieredkv.policy import CostModel
from tieredkv.tiers.nvme.block_io import BlockIO, IORequest
from tieredkv.tiers.nvme.io_backends import IOBackend, make_backend
from tieredkv.tiers.nvme.slot_format import ALIGN, aligned_empty
from tieredkv.user_cache import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_DISK_READ_BYTES_PER_S = 2e9  # a mid-range NVMe drive: assumed where the disk cannot be measured
MAX_PREFILL_PROBE = 8192  # tokens: prefill is timed in chunks of this size (at most)
MAX_CONTEXT_PROBE = 32768  # tokens: the cached context the second chunk attends to (at most)
DISK_PROBE_PASSES = 3  # the disk's read rate is the best of this many passes
DISK_PROBE_READS = 16  # each pass reads at least this many blocks (a stall of one is not the rate)


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


def measure_disk_read(
    directory: str, num_bytes: int = 64 << 20, read_bytes: int = 4 << 20, queue_depth: int = 1,
    backend: IOBackend = "sync",
) -> float | None:
    """Bytes/s of direct reads of `read_bytes` each, `queue_depth` in flight through the NVMe
    store's I/O `backend`, from a probe file written in `directory` (the engine measures its
    store's own path: slot-sized reads at the store's queue depth). None, with a warning,
    where the probe cannot be written (less than twice its size free, or a write error): the
    caller then assumes DEFAULT_DISK_READ_BYTES_PER_S."""
    why = None
    read_bytes = -(-read_bytes // ALIGN) * ALIGN
    num_bytes = max(num_bytes, DISK_PROBE_READS * read_bytes)
    try:
        free = shutil.disk_usage(directory).free
        if free < 2 * num_bytes:
            why = f"{free >> 20} MiB free, the probe needs {2 * num_bytes >> 20} MiB"
        else:
            return _probe_disk_read(directory, num_bytes, read_bytes, queue_depth, backend)
    except OSError as err:
        why = f"writing the probe file failed: {err}"
    logger.warning(
        "cannot measure the disk under %s (%s); assuming it reads %.1f GB/s: pin "
        "scheduler.cost_model.disk_read_bytes_per_s to say otherwise",
        directory, why, DEFAULT_DISK_READ_BYTES_PER_S / 1e9,
    )
    return None


def _probe_disk_read(directory: str, num_bytes: int, read_bytes: int, queue_depth: int, backend: IOBackend) -> float:
    """The best of DISK_PROBE_PASSES passes over the probe file, as prefill is timed: a disk
    that other work keeps busy for a moment at start-up (another engine, a store's file just
    made) read 54 MB/s in one pass where serving then read 1.4-2.6 GB/s, and the rate is cached.
    O_DIRECT where it works; otherwise the page cache is dropped for the file before each pass.
    The destination buffers are made and touched once, before any pass: faulting their pages in
    is not the disk's time."""
    path = os.path.join(directory, ".tieredkv-calibration")
    chunk = 4 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    try:
        with open(path, "wb") as f:
            for _ in range(-(-num_bytes // chunk)):
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        try:
            buffers = [aligned_empty(read_bytes) for _ in range(min(queue_depth, num_bytes // read_bytes))]
            for buffer in buffers:
                buffer.zero_()
            views = [memoryview(buffer.numpy()) for buffer in buffers]
            rates = []
            for _ in range(DISK_PROBE_PASSES):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                io = make_backend(backend, queue_depth, directory)
                rates.append(_timed_reads(fd, num_bytes, read_bytes, views, io))
            return max(rates)
        finally:
            os.close(fd)
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.remove(path)


def _timed_reads(fd: int, num_bytes: int, read_bytes: int, buffers: list[memoryview], io: BlockIO) -> float:
    """Read `num_bytes` of `fd` in `read_bytes` pieces, one in flight per buffer; bytes/s."""
    offsets = list(range(0, num_bytes - read_bytes + 1, read_bytes))
    total = len(offsets)
    free, done = list(range(len(buffers))), 0
    start = time.perf_counter()
    try:
        while done < total:
            while free and offsets:
                tag = free.pop()
                io.submit([IORequest(tag, "read", fd, offsets.pop(), (buffers[tag],))])
            for completion in io.reap(None):
                if completion.result != read_bytes:
                    raise OSError(f"a probe read returned {completion.result}")
                free.append(completion.tag)
                done += 1
    finally:
        io.close()
    return done * read_bytes / (time.perf_counter() - start)


def fit_chunks(n: int, context: int, t0: float, t1: float) -> tuple[float, float]:
    """(a, b) of a prefill costing a*N + b*N^2 for N tokens, from a chunk of `n` tokens timed
    at the start of a prompt (`t0` = a*n + b*n^2) and after `context` cached tokens (`t1` =
    a*n + b*((context + n)^2 - context^2)), clamped to non-negative terms: the chunk's extra
    time over a long context is its attention to that context, 2*b*context*n."""
    b = max(0.0, (t1 - t0) / (2 * context * n))
    a = max(0.0, t0 / n - b * n)
    if a == 0.0 and b == 0.0:
        a = t0 / n
    return a, b


def fit_prefill(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """(a, b) with a*n + b*n^2 through both points, clamped to non-negative terms."""
    b = max(0.0, (t2 / n2 - t1 / n1) / (n2 - n1))
    a = max(0.0, t1 / n1 - b * n1)
    if a == 0.0 and b == 0.0:
        a = t2 / n2
    return a, b


class DiskProbe(NamedTuple):
    """Where and how the NVMe store reads: its directory, read size, queue depth, backend."""

    directory: str
    read_bytes: int
    queue_depth: int
    backend: IOBackend


def _disk_id(directory: str) -> str:
    """The device under `directory`: folders on one disk share its measurement (a store in a
    fresh temporary folder, as `LLM.from_yaml` makes, is not measured again)."""
    try:
        return f"device {os.stat(directory).st_dev}"
    except OSError:  # not there: the probe will say so
        return os.path.abspath(directory)


def _describe(model: CostModel, probed: str, disk: DiskProbe | None) -> str:
    """The measured cost model in words and units, with how each figure was measured."""
    text = (f"copies D2H {model.d2h_bytes_per_s / 1e9:.1f} GB/s, H2D {model.h2d_bytes_per_s / 1e9:.1f} GB/s; "
            f"prefill {model.prefill_s_per_token * 1e6:.2f} us/token + {model.prefill_s_per_token_sq * 1e9:.3f} "
            f"ns/token^2 ({probed})")
    if disk is not None and model.disk_read_bytes_per_s is not None:
        text += (f"; disk reads {model.disk_read_bytes_per_s / 1e9:.2f} GB/s under {disk.directory} "
                 f"({disk.backend} backend, {disk.read_bytes / 1024:g} KiB reads, {disk.queue_depth} in flight)")
    return text


def calibrate(
    key: str, device: torch.device, prefill: Callable[[int, int], None], max_tokens: int,
    disk: DiskProbe | None = None, bandwidth: Callable[[], tuple[float, float]] | None = None,
    max_context_tokens: int = 0,
) -> CostModel:
    """The cost model for `key` (device + model [+ disk]), measured once and cached: the copies
    and prefill under the device and model's entry, the disk's read rate under an entry of its
    own, so that every engine of one model on one device (with a store or without) schedules
    with the same prefill figures. Prefill is timed as serving runs it: a chunk of `n` tokens,
    `n` the largest step (`max_tokens`, at most 8192), at the start of a prompt and after a long
    cached context (as much as one sequence holds, `max_context_tokens`, at most 32k), whose
    difference is the attention term; where no context of at least `n` fits, at `n` and `n/4`
    tokens (smaller probes time the per-step launch overhead, not the per-token cost of
    serving's chunks). `prefill(n, context)` runs one such chunk. `bandwidth` measures (D2H,
    H2D) bytes/s where `measure_bandwidth(device)` would not (the ranks of a tensor-parallel
    engine; `device` is then where `prefill` returns)."""
    n2 = max(2, min(MAX_PREFILL_PROBE, max_tokens))
    n1 = max(1, n2 // 4)
    context = min(MAX_CONTEXT_PROBE, max_context_tokens - n2)
    compute_entry = f"{key}/prefill:{n2}@0-{context}" if context >= n2 else f"{key}/prefill:{n1}-{n2}"
    disk_entry = None
    if disk is not None:
        disk_entry = f"{key}/disk:{_disk_id(disk.directory)}:{disk.read_bytes}x{disk.queue_depth}:{disk.backend}"
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    measured = False  # anything new to cache
    try:
        compute = CostModel(**cached[compute_entry])
        probed = "cached"
    except (KeyError, TypeError, ValueError):
        if compute_entry in cached:
            logger.warning("ignoring a damaged cost model cached in %s", path)
        compute, probed = _measure_compute(device, prefill, n1, n2, context, bandwidth)
        cached[compute_entry], measured = asdict(compute), True
    disk_rate = None
    if disk is not None:
        disk_rate = cached.get(disk_entry, {}).get("disk_read_bytes_per_s")
        if disk_rate is None:
            disk_rate = measure_disk_read(disk.directory, read_bytes=disk.read_bytes,
                                          queue_depth=disk.queue_depth, backend=disk.backend)
            if disk_rate is None:  # a guess where the disk could not be measured: not cached
                disk_rate = DEFAULT_DISK_READ_BYTES_PER_S
            else:
                cached[disk_entry], measured = {"disk_read_bytes_per_s": disk_rate}, True
    model = replace(compute, disk_read_bytes_per_s=disk_rate)
    if not measured:
        return model
    described = _describe(model, probed, disk if disk_entry in cached else None)
    logger.info("calibrated %s: %s; cached in %s", key, described, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    except OSError as err:
        logger.warning("could not cache the cost model in %s: %s", path, err)
    return model


def _measure_compute(
    device: torch.device, prefill: Callable[[int, int], None], n1: int, n2: int, context: int,
    bandwidth: Callable[[], tuple[float, float]] | None,
) -> tuple[CostModel, str]:
    """The copies' bandwidth and the prefill fit (`calibrate`), and how prefill was probed."""
    d2h, h2d = bandwidth() if bandwidth is not None else measure_bandwidth(device)
    if context >= n2:
        t0 = _timed(lambda: prefill(n2, 0), device)
        t1 = _timed(lambda: prefill(n2, context), device)
        (a, b), probed = fit_chunks(n2, context, t0, t1), f"a {n2}-token chunk after 0 and {context} cached tokens"
    else:
        t1 = _timed(lambda: prefill(n1, 0), device)
        t2 = _timed(lambda: prefill(n2, 0), device)
        (a, b), probed = fit_prefill(n1, t1, n2, t2), f"timed at {n1} and {n2} tokens"
    return CostModel(d2h, h2d, a, b, None), probed
