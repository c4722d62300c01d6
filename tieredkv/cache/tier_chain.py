"""The tiers below the GPU, wired in one place: `build_tiers(...)`.

    GPU pool ──evicts──► CPUOffload (CPU tier) ──turned down, spilled──► LowerTier ──► store
                                                 store: NVMe, remote, or both (`StorePair`)

Where the memory and the stores live is the host's: one process (`OneRankStores`, the model
runner's CPU tier) or one per rank (`parallel.workers.Workers`: a slice of every block and one
store per rank); the chain is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from tieredkv.cache.offload import CPUOffload
from tieredkv.config import CacheConfig
from tieredkv.memory import check_fits
from tieredkv.tiers.backend import BlockStore
from tieredkv.tiers.nvme.opener import open_store
from tieredkv.tiers.remote import StorePair, open_remote
from tieredkv.transfer.engine import TransferEngine

if TYPE_CHECKING:
    from tieredkv.parallel.sharded_remote import ShardedRemote
    from tieredkv.tiers.cpu import CPUTier
    from tieredkv.tiers.remote.shards import RemoteShards
    from tieredkv.tiers.remote.store import RemoteStore  # imports redis, an optional dependency

    RemoteTier = RemoteStore | RemoteShards | ShardedRemote


class TierHost(Protocol):
    """What holds the CPU tier and opens the stores below it."""

    def cpu_tier(self, num_blocks: int) -> tuple[CPUTier, TransferEngine]: ...

    def open_store(self, cache: CacheConfig, fingerprint: int) -> BlockStore: ...

    def open_remote(self, cache: CacheConfig, fingerprint: int) -> RemoteTier: ...


class OneRankStores:
    """A one-rank engine's host: the model runner's CPU tier; an NVMe store file and a remote
    store of whole blocks of `block_bytes`."""

    def __init__(self, cpu_tier: Callable[[int], tuple[CPUTier, TransferEngine]], block_bytes: int) -> None:
        self.cpu_tier = cpu_tier
        self.block_bytes = block_bytes

    def open_store(self, cache: CacheConfig, fingerprint: int) -> BlockStore:
        return open_store(cache.nvme_path, cache.nvme_bytes, self.block_bytes, fingerprint, cache.block_size,
                          backend=cache.io_backend, policy=cache.nvme_policy)

    def open_remote(self, cache: CacheConfig, fingerprint: int) -> RemoteTier:
        return open_remote(cache.remote_url, cache.remote_bytes, self.block_bytes, fingerprint, cache.block_size)


class Tiers(NamedTuple):
    """The chain below the GPU (None: no CPU tier) and the remote tier's own store, if any (its
    stats and read bandwidth are the engine's to report)."""

    offload: CPUOffload | None
    remote: RemoteTier | None


def build_tiers(cache: CacheConfig, block_bytes: int, fingerprint: int, host: TierHost) -> Tiers:
    """The CPU tier of `cache.cpu_cache_bytes` and below it the lower tier: the NVMe store, the
    remote one, or both (reads from the first that holds a block, writes to both). ValueError
    naming the key when the CPU tier holds no block."""
    if cache.cpu_cache_bytes == 0:  # EngineConfig checked that nothing needs a CPU tier
        return Tiers(None, None)
    num_blocks = cache.cpu_cache_bytes // block_bytes
    if num_blocks == 0:
        raise ValueError(
            f"cpu_cache_bytes: {cache.cpu_cache_bytes} bytes hold no KV block of {block_bytes} bytes; "
            "raise it or set it to 0 to run without a CPU tier"
        )
    check_fits("cpu_cache_bytes", num_blocks, block_bytes, torch.device("cpu"))
    tier, transfers = host.cpu_tier(num_blocks)
    nvme = host.open_store(cache, fingerprint) if cache.nvme_path is not None else None
    remote = host.open_remote(cache, fingerprint) if cache.remote_url is not None else None
    below = nvme if remote is None else StorePair(nvme, remote)
    return Tiers(CPUOffload(tier, transfers, below, cache.cpu_policy), remote)
