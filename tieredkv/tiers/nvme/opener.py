"""The engine's door to the NVMe store: `open_store(...)` opens an `NVMeStore` and says what
went wrong in terms of the config keys (`nvme_path`, `nvme_bytes`)."""

from __future__ import annotations

from tieredkv.replacement import ReplacementPolicy
from tieredkv.tiers.nvme.block_io import FULL_DISK_ERRNOS
from tieredkv.tiers.nvme.io_backends import IOBackend
from tieredkv.tiers.nvme.slot_file import StoreInUseError
from tieredkv.tiers.nvme.slot_format import SlotGeometry
from tieredkv.tiers.nvme.store import NVMeStore


def open_store(
    nvme_path: str,
    nvme_bytes: int,
    block_bytes: int,
    fingerprint: bytes | int,
    block_size: int,
    backend: IOBackend = "uring",
    policy: ReplacementPolicy = "adaptive",
) -> NVMeStore:
    """The engine's store, with errors that name the config key to change (`nvme_path` or
    `nvme_bytes`) as ValueError, also when another engine holds the store."""
    need = SlotGeometry.min_capacity_bytes(block_bytes, block_size)
    if nvme_bytes < need:
        raise ValueError(
            f"nvme_bytes: {nvme_bytes} bytes hold no slot for one KV block of {block_bytes} bytes "
            f"(with its header); give at least {need} bytes, e.g. '{-(-need // 2**20)}MiB'"
        )
    try:
        return NVMeStore(nvme_path, nvme_bytes, block_bytes, fingerprint, block_size, backend, policy=policy)
    except ValueError as err:
        raise ValueError(f"nvme_path: {err}") from err
    except StoreInUseError as err:
        raise ValueError(
            f"cache.nvme_path: the store {err.path} is in use by another engine ({err.holder}); "
            "close that engine first, or give this one another nvme_path"
        ) from None
    except OSError as err:
        if err.errno in FULL_DISK_ERRNOS:
            raise ValueError(
                f"nvme_bytes: {nvme_bytes} bytes do not fit at {nvme_path!r}: {err.strerror}; "
                "lower nvme_bytes or free some space"
            ) from err
        raise ValueError(f"nvme_path: cannot use {nvme_path!r} for the block store: {err}") from err
