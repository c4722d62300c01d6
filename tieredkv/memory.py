"""How much memory a device has left, to refuse a KV tier that cannot fit before allocating it.
Operations: `available_bytes(device)`, `check_fits(key, num_blocks, block_bytes, device)`,
`fit_gpu_blocks(cache, block_bytes, device)`."""

from __future__ import annotations

import os

import torch

from tieredkv.config import CacheConfig

DEFAULT_CPU_GPU_BLOCKS = 256  # the "GPU" tier of a CPU device, unless num_gpu_blocks says


def available_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, or the host's available memory (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_fits(key: str, num_blocks: int, block_bytes: int, device: torch.device) -> None:
    """ValueError naming `key` if `num_blocks` KV blocks exceed the memory `device` has left."""
    need, available = num_blocks * block_bytes, available_bytes(device)
    if available is not None and need > available:
        raise ValueError(
            f"{key}: {num_blocks} blocks of {block_bytes} bytes need {need / 2**30:.1f} GiB but "
            f"{device.type} memory has {available / 2**30:.1f} GiB available; lower {key}"
        )


def fit_gpu_blocks(cache: CacheConfig, block_bytes: int, device: torch.device) -> int:
    """Blocks of `block_bytes` that `gpu_memory_utilization` leaves on a CUDA device (CPU:
    DEFAULT_CPU_GPU_BLOCKS); ValueError if none."""
    if device.type != "cuda":
        return DEFAULT_CPU_GPU_BLOCKS
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1 - cache.gpu_memory_utilization) * total
    num = int(budget // block_bytes)
    if num < 1:
        raise ValueError("gpu_memory_utilization: leaves no memory for the KV cache; raise it or set num_gpu_blocks")
    return num
