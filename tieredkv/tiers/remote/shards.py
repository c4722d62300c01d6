"""Blocks spread over several Redis servers, one `RemoteStore` each, as one store.

    shards = RemoteShards([RemoteStore(url, ...) for url in urls])
    shards.server_of(block_hash)     # the index of the one server that holds a block
    shards.contains_run(hashes)      # each server asked about its blocks, all servers at once
    (the `BlockStore` API; stats() summed; measure_read_bandwidth() of all servers at once)

A block lives on one server: the one with the highest xxh3(server name ‖ block hash)
(rendezvous hashing). Every engine that lists the same servers, in any order, picks the same
one; a server that is lost takes only its share of the blocks with it (those reads fail and are
recomputed), and the others keep theirs. Each server has its own link, health checks and epoch:
one restarted empty makes the engine forget only its blocks.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.remote.chain import StoreSet
from tieredkv.tiers.remote.store import RemoteStore


def server_name(url: str) -> str:
    """What names a server whatever the URL's spelling: host:port/db, or the socket's path."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    db = parts.path.strip("/") or "0"
    return f"{parts.hostname}:{parts.port or 6379}/{db}"


class RemoteShards(StoreSet):
    """A `BlockStore` over several remote stores, one per server (module docstring)."""

    def __init__(self, stores: list[RemoteStore]) -> None:
        """ValueError if two stores name the same server."""
        names = [server_name(store.url) for store in stores]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"the server {twice[0]} is listed twice; list each server once")
        super().__init__(list(stores))
        self._names = [name.encode() for name in names]
        self._lookups = ThreadPoolExecutor(len(stores), thread_name_prefix="tieredkv-remote-lookup")

    def server_of(self, block_hash: int) -> int:
        key = block_hash.to_bytes(8, "little")
        scores = [xxhash.xxh3_64_intdigest(name + key) for name in self._names]
        return scores.index(max(scores))

    def contains(self, block_hash: int) -> bool:
        return self.stores[self.server_of(block_hash)].contains(block_hash)

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading blocks are stored: each server is asked about its own (one
        round trip each, all at once); the run ends at the first block its server lacks."""
        positions: list[list[int]] = [[] for _ in self.stores]
        for pos, block_hash in enumerate(block_hashes):
            positions[self.server_of(block_hash)].append(pos)
        asked = [(store, pos) for store, pos in zip(self.stores, positions, strict=True) if pos]
        runs = self._lookups.map(lambda each: each[0].contains_run([block_hashes[p] for p in each[1]]), asked)
        misses = [pos[run] for (_, pos), run in zip(asked, runs, strict=True) if run < len(pos)]
        return min(misses, default=len(block_hashes))

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        i = self.server_of(ref.block_hash)
        inner = self.stores[i].submit_read(ref, dst)
        return None if inner is None else self._new_job([(i, inner)])

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        i = self.server_of(ref.block_hash)
        inner = self.stores[i].submit_write(ref, src)
        return None if inner is None else self._new_job([(i, inner)])

    def close(self) -> None:
        self._lookups.shutdown()
        super().close()

    def stats(self) -> dict[str, int | float | str | bool]:
        """The servers' `remote_*` counters summed; `remote_connected` while all are reachable,
        `remote_servers_up` how many are; `remote_read_busy_s` the longest of any server (they
        read at once: the bytes over it are the read bandwidth the loads get)."""
        each = [store.stats() for store in self.stores]
        out: dict[str, int | float | str | bool] = {}
        for name in each[0]:
            values = [s[name] for s in each]
            out[name] = all(values) if isinstance(values[0], bool) else sum(values)
        out["remote_read_busy_s"] = max(s["remote_read_busy_s"] for s in each)
        out["remote_servers_up"] = sum(bool(s["remote_connected"]) for s in each)
        return out

    def measure_read_bandwidth(self, num_bytes: int = 64 << 20, max_blocks: int = 256) -> float | None:
        """Bytes/s of block reads from all servers at once (each probed as `RemoteStore` does,
        at the same time); None if no server could be measured."""
        return read_bandwidth_together(self.stores, num_bytes, max_blocks)


def read_bandwidth_together(stores: Sequence[RemoteStore | RemoteShards], num_bytes: int,
                            max_blocks: int) -> float | None:
    """Bytes/s of block reads from `stores` probed at the same time (their bytes add up); None if
    none could be measured."""
    with ThreadPoolExecutor(len(stores)) as pool:
        rates = list(pool.map(lambda s: s.measure_read_bandwidth(num_bytes, max_blocks), stores))
    measured = [rate for rate in rates if rate is not None]
    return sum(measured) if measured else None
