"""Several block stores as one: `StoreSet` routes jobs to its stores and reports them as its own;
`StorePair` is two block stores below the CPU tier: a local one (NVMe, optional) and a remote one.

    store = StorePair(local=nvme_store_or_None, remote=remote_store)
    store.contains(h)           # local first (no network), then remote
    store.contains_run(hashes)  # the leading blocks either holds: at most one round trip a run
    store.submit_read(ref, dst) # from the first store that holds the block
    store.submit_write(ref, src)  # to both; one job, done when both are, ok if either stored it
    store.take_lost()           # what either lost (a block still in the other is found there again)
    store.poll(); store.wait(jobs); store.stats(); store.close()

`stats()` is the local store's (zeros without one), which the spill path reports as the
`nvme_*` stats (an engine without NVMe drops those of `NVME_STORE_STATS`), with the bytes read
and the time spent reading of both stores; the remote store reports its own (`remote_*`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from tieredkv.tiers.backend import BlockRef, BlockStore, LostBlocks

# what an NVMe store's stats() holds, for the spill path when there is no local store
NO_LOCAL_STATS: dict[str, int | float | str | bool] = {
    **dict.fromkeys(("slots_total slots_used hits corrupt io_errors enospc short_reads short_writes files_lost "
                     "internal_errors restored scan_discarded reformatted bytes_written bytes_read").split(), 0),
    "read_busy_s": 0.0,
    "backend": "none",
}


# the spill path's stats that describe the NVMe store itself: an engine without one drops them
NVME_STORE_STATS = ("nvme_slots_total nvme_slots_used nvme_io_backend nvme_hits nvme_corrupt nvme_io_errors "
                    "nvme_files_lost nvme_internal_errors nvme_restored nvme_scan_discarded nvme_reformatted "
                    "nvme_bytes_written nvme_bytes_read").split()


class StoreSet(BlockStore):
    """The jobs of several stores as one store's: a job is parts in some of them, done when all
    are, ok if any part is."""

    def __init__(self, stores: list[BlockStore]) -> None:
        self.stores = stores
        self._ids = itertools.count(1)
        self._parts: dict[int, set[tuple[int, int]]] = {}  # job -> (store index, inner job) left
        self._ok: dict[int, bool] = {}  # job -> whether a part succeeded
        self._owner: dict[tuple[int, int], int] = {}  # (store index, inner job) -> job
        self._done: list[tuple[int, bool]] = []  # finished jobs not reported yet

    def record(self, block_hashes: Sequence[int], num_hits_above: int) -> None:
        for store in self.stores:
            store.record(block_hashes, num_hits_above)

    def take_lost(self) -> LostBlocks:
        return LostBlocks.merge(store.take_lost() for store in self.stores)

    def poll(self) -> list[tuple[int, bool]]:
        for i, store in enumerate(self.stores):
            for inner, ok in store.poll():
                self._part_done((i, inner), ok)
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, bool]:
        """Block until the jobs finished; {job: ok}. They are not reported by poll() again."""
        ids = list(job_ids)
        bad = [j for j in ids if j not in self._parts and all(j != d for d, _ in self._done)]
        if bad:
            raise KeyError(f"job ids {bad[:8]} are unknown or reported already")
        for i, store in enumerate(self.stores):
            inner = [p for j in ids for s, p in self._parts.get(j, ()) if s == i]
            for part, ok in store.wait(inner, timeout).items() if inner else ():
                self._part_done((i, part), ok)
        finished = {j: ok for j, ok in self._done if j in ids}
        self._done = [(j, ok) for j, ok in self._done if j not in finished]
        return finished

    def close(self) -> None:
        for store in self.stores:
            store.close()

    def __enter__(self) -> StoreSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_job(self, parts: list[tuple[int, int]]) -> int:
        job = next(self._ids)
        self._parts[job] = set(parts)
        self._ok[job] = False
        for part in parts:
            self._owner[part] = job
        return job

    def _part_done(self, part: tuple[int, int], ok: bool) -> None:
        job = self._owner.pop(part)
        left = self._parts[job]
        left.discard(part)
        self._ok[job] = self._ok[job] or ok
        if not left:
            del self._parts[job]
            self._done.append((job, self._ok.pop(job)))


class StorePair(StoreSet):
    """A `BlockStore` over a local and a remote store (module docstring)."""

    def __init__(self, local: BlockStore | None, remote: BlockStore) -> None:
        super().__init__([s for s in (local, remote) if s is not None])
        self.local, self.remote = local, remote

    def contains(self, block_hash: int) -> bool:
        return any(store.contains(block_hash) for store in self.stores)

    def contains_run(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading blocks one store or the other holds: the runs of each in turn,
        until neither goes further (the remote store remembers what it was asked about, so a
        block the local store holds between remote ones costs no new round trip)."""
        held, grew = 0, True
        while grew and held < len(block_hashes):
            grew = False
            for store in self.stores:
                run = store.contains_run(block_hashes[held:])
                held, grew = held + run, grew or run > 0
        return held

    def submit_read(self, ref: BlockRef, dst: torch.Tensor) -> int | None:
        for i, store in enumerate(self.stores):
            if store.contains(ref.block_hash):
                inner = store.submit_read(ref, dst)
                return None if inner is None else self._new_job([(i, inner)])
        return None

    def submit_write(self, ref: BlockRef, src: torch.Tensor) -> int | None:
        parts = [(i, store.submit_write(ref, src)) for i, store in enumerate(self.stores)]
        started = [(i, inner) for i, inner in parts if inner is not None]
        return self._new_job(started) if started else None

    def stats(self) -> dict[str, int | float | str | bool]:
        """The local store's stats, with `bytes_read` and `read_busy_s` of both stores (reads
        from either tier: the read bandwidth the loads get)."""
        out = self.local.stats() if self.local is not None else dict(NO_LOCAL_STATS)
        remote = self.remote.stats()
        out["bytes_read"] += remote["remote_bytes_read"]
        out["read_busy_s"] += remote["remote_read_busy_s"]
        return out
