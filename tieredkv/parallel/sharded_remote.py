"""The remote tier of a tensor-parallel engine: one remote store per rank on the same servers.

Each rank's share of a block (its KV heads, the slice in its CPU tier) is a value of its own,
under the block's key qualified by the rank (`rank_key_suffix`):

    tieredkv:<model fingerprint>:<block hash>:r<rank>of<world>

The fingerprint carries the tensor-parallel layout, so engines of another layout never read
these values. `ShardedRemote` is `RankStores` over the ranks' stores: a block is a hit only if
every rank's value is there and verifies; a missing or corrupt one on any rank fails the read
for the block, a miss on every rank (recomputed). `remote_bytes` is a total, split evenly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tieredkv.config import CacheConfig
from tieredkv.parallel.sharded_tiers import RankStores
from tieredkv.tiers.remote import open_remote

if TYPE_CHECKING:  # they import redis, an optional dependency (open_remote says so by the config key)
    from tieredkv.tiers.remote.shards import RemoteShards
    from tieredkv.tiers.remote.store import RemoteStore

__all__ = ["ShardedRemote", "open_sharded_remote", "rank_key_suffix"]


def rank_key_suffix(rank: int, world: int) -> str:
    """What rank `rank`'s store appends to a block's key."""
    return f":r{rank}of{world}"


def open_sharded_remote(cache: CacheConfig, rank_block_bytes: int, fingerprint: int, world: int) -> ShardedRemote:
    """One remote store per rank on `cache.remote_url` (each on every server listed),
    `remote_bytes / world` each; errors name the config key as `open_remote`'s do."""
    assert cache.remote_url is not None, "no remote tier configured"
    stores: list[RemoteStore | RemoteShards] = []
    try:
        for rank in range(world):
            stores.append(open_remote(cache.remote_url, cache.remote_bytes // world, rank_block_bytes, fingerprint,
                                      cache.block_size, key_suffix=rank_key_suffix(rank, world)))
    except BaseException:
        for store in stores:
            store.close()
        raise
    return ShardedRemote(stores)


class ShardedRemote(RankStores):
    """The remote tier over one store per rank (module docstring)."""

    def stats(self) -> dict[str, int | float | str | bool]:
        """The `remote_*` counters of a one-rank engine: `remote_hit_blocks` blocks read back
        and verified on every rank, `remote_stored_blocks` and `remote_owned_blocks` those of
        the rank with fewest; faults, bytes and the rest summed over the ranks;
        `remote_read_busy_s` the longest of any rank (they read at once); `remote_connected`
        while every rank's link is up."""
        each = [store.stats() for store in self.stores]
        out: dict[str, int | float | str | bool] = {}
        for name in each[0]:
            values = [s[name] for s in each]
            out[name] = all(values) if isinstance(values[0], bool) else sum(values)
        out.update(
            remote_hit_blocks=self._counts["hits"],
            remote_stored_blocks=min(s["remote_stored_blocks"] for s in each),
            remote_owned_blocks=min(s["remote_owned_blocks"] for s in each),
            remote_read_busy_s=max(s["remote_read_busy_s"] for s in each),
        )
        return out

    def measure_read_bandwidth(self, num_bytes: int = 64 << 20, max_blocks: int = 256) -> float | None:
        """Bytes/s of whole blocks: every rank's store probed at the same time (the ranks read
        their shares at once, so their bytes add up); None if no rank's could be measured."""
        from tieredkv.tiers.remote.shards import read_bandwidth_together  # needs redis-py: imported in use

        return read_bandwidth_together(self.stores, num_bytes, max_blocks)
