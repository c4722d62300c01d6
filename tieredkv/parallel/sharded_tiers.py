"""The CPU and NVMe tiers of a tensor-parallel engine, sharded by rank, as the driver holds them.

- `ShardedCPUTier`: one block-major tensor per rank, in memory the driver and that rank's
  process both map (a memfd): the rank copies its KV heads of a block to and from it over its
  own PCIe link (pinned by the rank), the driver reads and writes it to NVMe. `blocks[i]` is block
  i's slices, one per rank (`RankBlocks`).

      rank r's tier: [num_blocks, layers, 2, block_size, kv_heads of rank r, head_dim]

- `RankStores`: one block store per rank behind the `BlockStore` interface, with a block's
  slices for `src`/`dst`. A block is stored only when every rank's store holds its slice; a
  read that fails on one rank (I/O error, checksum, a missing value) fails for the block, a
  miss for every rank (the block is recomputed).
- `ShardedStore`: the NVMe tier, one store per rank (a folder `tp<N>-rank<r>` under
  `nvme_path`, each with its own file and a fingerprint naming its rank). Sizes are totals:
  `nvme_bytes` is split evenly. (`sharded_remote.py`: the remote tier, the same way.)
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from tieredkv.config import CacheConfig
from tieredkv.tiers.backend import BlockRef, BlockStore, LostBlocks
from tieredkv.tiers.cpu import BlockViews
from tieredkv.tiers.nvme.opener import open_store
from tieredkv.tiers.nvme.store import NVMeStore


def shared_memory(nbytes: int, name: str) -> tuple[int, torch.Tensor]:
    """`nbytes` zeroed bytes another process can map: a memfd (its file descriptor) and this
    process's map of it, as a uint8 tensor (page-aligned, so that O_DIRECT I/O needs no copy)."""
    fd = os.memfd_create(name)
    try:
        os.ftruncate(fd, nbytes)
        buffer = mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd, torch.frombuffer(buffer, dtype=torch.uint8)


class RankBlocks:
    """`blocks[i]`: CPU block i of every rank, as a tuple of tensors in rank order (`BlockViews`)."""

    def __init__(self, ranks: list[torch.Tensor]) -> None:
        self.ranks = ranks
        self._views = [BlockViews(rank) for rank in ranks]

    def __getitem__(self, block_id: int) -> tuple[torch.Tensor, ...]:
        return tuple(views[block_id] for views in self._views)

    def __len__(self) -> int:
        return len(self.ranks[0])


class ShardedCPUTier:
    """`num_blocks` CPU blocks, each a slice of `rank_block_shape` per rank (module docstring)."""

    def __init__(self, num_blocks: int, rank_block_shape: tuple[int, ...], dtype: torch.dtype, world: int) -> None:
        shape = (num_blocks, *rank_block_shape)
        self.rank_nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.fds: list[int] = []
        ranks = []
        try:
            for rank in range(world):
                fd, memory = shared_memory(self.rank_nbytes, f"tieredkv-cpu-tier-rank{rank}")
                self.fds.append(fd)
                ranks.append(memory.view(dtype).view(shape))
        except BaseException:
            self.close_fds()
            raise
        self.blocks = RankBlocks(ranks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def close_fds(self) -> None:
        """Close the file descriptors once every rank has mapped its memory (the maps stay)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def close(self) -> None:
        self.close_fds()


def rank_fingerprint(fingerprint: int, rank: int) -> int:
    """The fingerprint of rank `rank`'s store: its file holds that rank's heads only."""
    return xxhash.xxh3_64_intdigest(f"{fingerprint:016x}/rank{rank}".encode())


def open_sharded_store(cache: CacheConfig, rank_block_bytes: int, fingerprint: int, world: int) -> ShardedStore:
    """One store per rank under `cache.nvme_path` (a directory), `nvme_bytes / world` each."""
    assert cache.nvme_path is not None, "no NVMe tier configured"
    if os.path.isfile(cache.nvme_path):
        raise ValueError(
            f"nvme_path: {cache.nvme_path!r} is a file; with tensor_parallel_size {world} give a directory "
            "(each rank keeps its own store file in a folder under it)"
        )
    stores: list[NVMeStore] = []
    try:
        for rank in range(world):
            path = os.path.join(cache.nvme_path, f"tp{world}-rank{rank}")
            stores.append(open_store(path, cache.nvme_bytes // world, rank_block_bytes,
                                     rank_fingerprint(fingerprint, rank), cache.block_size, cache.io_backend,
                                     cache.nvme_policy))
    except BaseException:
        for store in stores:
            store.close()
        raise
    return ShardedStore(stores)


@dataclass
class _Job:
    """A block's jobs on the ranks' stores: the ones not finished yet, and whether all went well."""

    kind: str
    left: dict[int, int] = field(default_factory=dict)  # rank -> its store's job
    ok: bool = True
    reported: bool = True  # False: a write that cannot make the block whole runs on, unreported


_SUMMED = (
    "bytes_read bytes_written evictions write_rejected corrupt io_errors enospc short_reads short_writes "
    "files_lost scan_discarded reformatted internal_errors"
).split()


class RankStores(BlockStore):
    """A `BlockStore` over one store per rank; `src`/`dst` are a block's slices (`RankBlocks[i]`).
    Counts blocks read back (`hits`) and written (`writes`) on every rank, and `misses`."""

    def __init__(self, stores: Sequence[BlockStore]) -> None:
        self.stores = list(stores)
        self._ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._owner: dict[tuple[int, int], int] = {}  # (rank, its job) -> job
        self._counts: Counter[str] = Counter(hits=0, misses=0, writes=0)

    def contains(self, block_hash: int) -> bool:
        return all(store.contains(block_hash) for store in self.stores)

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading blocks every rank's store holds."""
        return min(store.contains_run(block_hashes) for store in self.stores)

    def record(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        """Every rank's store counts the request alike, so their victims stay the same."""
        for store in self.stores:
            store.record(block_hashes, num_hits_above)

    def submit_write(self, ref: BlockRef, src: Sequence[torch.Tensor]) -> int | None:
        """Write every rank's slice; None if the block will not be whole: no rank's store
        started a write (each holds the block already, or has no room), or a rank that started
        none does not hold it (no room there). The writes other ranks started then run on, and
        are not reported: the block is not stored, and `contains` says so."""
        started = [store.submit_write(ref, part) for store, part in zip(self.stores, src, strict=True)]
        job = self._start("write", started)
        if job is not None and any(sub is None and not store.contains(ref.block_hash)
                                   for store, sub in zip(self.stores, started, strict=True)):
            self._jobs[job].reported = False
            return None
        return job

    def submit_read(self, ref: BlockRef, dst: Sequence[torch.Tensor]) -> int | None:
        """Read every rank's slice; None if no rank holds it. If some rank misses it, the reads
        that started still finish (into `dst`), and the job fails."""
        if not self.contains(ref.block_hash):
            self._counts["misses"] += 1
            return None
        started = [store.submit_read(ref, part) for store, part in zip(self.stores, dst, strict=True)]
        job = self._start("read", started)
        if job is not None and None in started:
            self._jobs[job].ok = False
        return job

    def _start(self, kind: str, started: list[int | None]) -> int | None:
        if all(sub is None for sub in started):
            return None
        job_id = next(self._ids)
        job = self._jobs[job_id] = _Job(kind)
        for rank, sub in enumerate(started):
            if sub is not None:
                job.left[rank] = sub
                self._owner[rank, sub] = job_id
        return job_id

    def _settle(self, rank: int, sub: int, ok: bool) -> tuple[int, bool] | None:
        """Book one rank's finished job; (job, ok) once the block's last one is done."""
        job_id = self._owner.pop((rank, sub))
        job = self._jobs[job_id]
        del job.left[rank]
        job.ok &= ok
        if job.left:
            return None
        del self._jobs[job_id]
        if not job.reported:
            return None
        if job.ok:
            self._counts["hits" if job.kind == "read" else "writes"] += 1
        return job_id, job.ok

    def take_lost(self) -> LostBlocks:
        """What any rank's store lost: the block is no longer whole."""
        return LostBlocks.merge(store.take_lost() for store in self.stores)

    def poll(self) -> list[tuple[int, bool]]:
        done = []
        for rank, store in enumerate(self.stores):
            for sub, ok in store.poll():
                settled = self._settle(rank, sub, ok)
                if settled is not None:
                    done.append(settled)
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
        ids = list(job_ids)
        unknown = [i for i in ids if i not in self._jobs]
        if unknown:
            raise KeyError(f"job ids {unknown[:8]} are unknown or reported already")
        by_rank: dict[int, list[int]] = {}
        for job_id in ids:
            for rank, sub in self._jobs[job_id].left.items():
                by_rank.setdefault(rank, []).append(sub)
        results = {}
        for rank, subs in by_rank.items():
            for sub, ok in self.stores[rank].wait(subs, timeout).items():
                settled = self._settle(rank, sub, ok)
                if settled is not None:
                    results[settled[0]] = settled[1]
        return results

    def close(self) -> None:
        for store in self.stores:
            store.close()


class ShardedStore(RankStores):
    """The NVMe tier of a tensor-parallel engine: one `NVMeStore` per rank (module docstring)."""

    def __init__(self, stores: list[NVMeStore]) -> None:
        super().__init__(stores)
        on_all = set.intersection(*(set(s.index.stored_hashes()) for s in stores))
        self._restored = len(on_all)

    def stats(self) -> dict[str, int | float | str | bool]:
        """Blocks (on every rank) for hits, misses, writes, slots and restored blocks; faults
        and bytes summed over the ranks; `read_busy_s` the longest of any rank."""
        each = [store.stats() for store in self.stores]
        out: dict[str, int | float | str | bool] = dict(self._counts)
        out.update({key: sum(s[key] for s in each) for key in _SUMMED})
        out.update(
            slots_total=min(s["slots_total"] for s in each),
            slots_used=min(s["slots_used"] for s in each),
            slots_free=min(s["slots_free"] for s in each),
            in_flight=sum(s["in_flight"] for s in each),
            read_busy_s=max(s["read_busy_s"] for s in each),  # the ranks' stores read at once
            backend=each[0]["backend"],
            o_direct=all(s["o_direct"] for s in each),
            restored=self._restored,
        )
        return out

    def sync(self) -> bool:
        return all([store.sync() for store in self.stores])
