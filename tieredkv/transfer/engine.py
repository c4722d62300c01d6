"""Moves KV blocks between the GPU tier and the CPU tier.

Two-phase API: `submit(job) -> id`, `poll() -> finished ids`, `wait(ids)`; `order_compute(later)`
makes the next forward pass wait (on the GPU, never the host) for the transfers it depends on,
all but the jobs in `later`, which only a later forward pass reads.

On CUDA, a D2H job runs on its own stream:

    gpu blocks ──gather kernel──► staging (HBM, block-major) ──DMA──► pinned CPU blocks

and an H2D job the other way on a second stream. Scattered blocks become a few large DMAs
(one per run of consecutive CPU blocks), chunked through a staging buffer of bounded size.
On the CPU, jobs copy synchronously behind the same API.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch

TransferKind = Literal["d2h", "h2d"]
KV_TO_BLOCK_MAJOR = (2, 0, 1, 3, 4, 5)  # [L, 2, n, bs, h, d] -> [n, L, 2, bs, h, d]
BLOCK_TO_KV_MAJOR = (1, 2, 0, 3, 4, 5)


class TransferError(RuntimeError):
    """A transfer could not be started; its destination holds no valid KV."""


@dataclass(frozen=True)
class TransferJob:
    """Copy GPU block `gpu_block_ids[i]` to/from CPU block `cpu_block_ids[i]`."""

    kind: TransferKind
    gpu_block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]


def consecutive_runs(ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Split `ids` into runs of consecutive values: (position in ids, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            pos, first, length = runs[-1]
            runs[-1] = (pos, first, length + 1)
        else:
            runs.append((i, block, 1))
    return runs


class TransferEngine:
    """Synchronous copies (CPU device); the CUDA engine overrides `_start` and friends."""

    finishes_between_steps = True  # `poll` finds jobs finished with no step run since

    def __init__(self, kv_cache: torch.Tensor, cpu_data: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.cpu_data = cpu_data
        self.block_bytes = cpu_data[0].numel() * cpu_data.element_size()
        self._ids = itertools.count()
        self._finished: list[int] = []
        self.bytes_moved = {"d2h": 0, "h2d": 0}
        self.jobs_started = {"d2h": 0, "h2d": 0}
        self.submit_s = {"d2h": 0.0, "h2d": 0.0}  # the caller's time in `submit`, jobs that started
        self.num_failures = 0
        self._wait_s = 0.0  # compute time lost to transfers, see `compute_wait_s`

    def submit(self, job: TransferJob) -> int:
        """Start `job`; raise TransferError if it cannot run (nothing was copied)."""
        assert len(job.gpu_block_ids) == len(job.cpu_block_ids), "one CPU block per GPU block"
        job_id = next(self._ids)
        start = time.perf_counter()
        try:
            self._start(job_id, job)
        except (RuntimeError, ValueError) as err:
            self.num_failures += 1
            raise TransferError(f"{job.kind} transfer of {len(job.gpu_block_ids)} blocks failed: {err}") from err
        self.submit_s[job.kind] += time.perf_counter() - start
        self.jobs_started[job.kind] += 1
        self.bytes_moved[job.kind] += len(job.gpu_block_ids) * self.block_bytes
        return job_id

    @property
    def compute_wait_s(self) -> float:
        """Seconds the forward passes stood still for transfers (here: the synchronous copies)."""
        return self._wait_s

    def _start(self, job_id: int, job: TransferJob) -> None:
        start = time.perf_counter()
        gpu = torch.tensor(job.gpu_block_ids, dtype=torch.int64)
        cpu = torch.tensor(job.cpu_block_ids, dtype=torch.int64)
        if job.kind == "d2h":
            self.cpu_data[cpu] = self.kv_cache[:, :, gpu].permute(KV_TO_BLOCK_MAJOR)
        else:
            self.kv_cache[:, :, gpu] = self.cpu_data[cpu].permute(BLOCK_TO_KV_MAJOR)
        self._finished.append(job_id)
        self._wait_s += time.perf_counter() - start

    def poll(self) -> list[int]:
        """Ids of jobs that finished since the last call."""
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: list[int]) -> None:
        """Block the host until these jobs have finished (their ids still come out of `poll`)."""

    def order_compute(self, later: Collection[int] = ()) -> None:
        """Make the next forward pass wait for the transfers submitted so far, except the jobs
        in `later` (a later call orders those)."""

    def wait_all(self) -> None:
        """Block the host until every submitted job has finished."""
        self.wait(list(range(next(self._ids))))


def make_transfer_engine(kv_cache: torch.Tensor, cpu_data: torch.Tensor) -> TransferEngine:
    if kv_cache.is_cuda:
        from tieredkv.transfer.cuda import CudaTransferEngine

        return CudaTransferEngine(kv_cache, cpu_data)
    return TransferEngine(kv_cache, cpu_data)


class FaultyTransfers:
    """Wraps a transfer engine and makes chosen jobs fail to start, for tests of the failure
    paths: `inject("h2d", every=2)` fails every second H2D job with TransferError (nothing is
    copied, as when a real DMA cannot start). Everything else goes to the wrapped engine."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self._every: dict[TransferKind, int] = {}
        self._seen: dict[TransferKind, int] = {"d2h": 0, "h2d": 0}
        self.injected = 0

    def inject(self, kind: TransferKind, every: int = 1) -> None:
        """Fail every `every`-th job of `kind` from now on."""
        self._every[kind] = every

    def submit(self, job: TransferJob) -> int:
        every = self._every.get(job.kind)
        if every is not None:
            self._seen[job.kind] += 1
            if self._seen[job.kind] % every == 0:
                self.injected += 1
                raise TransferError(f"{job.kind} transfer of {len(job.gpu_block_ids)} blocks failed: injected")
        return self.inner.submit(job)

    @property
    def finishes_between_steps(self) -> bool:
        return self.inner.finishes_between_steps

    def poll(self) -> list[int]:
        return self.inner.poll()

    def wait(self, job_ids: list[int]) -> None:
        self.inner.wait(job_ids)

    def order_compute(self, later: Collection[int] = ()) -> None:
        self.inner.order_compute(later)

    def wait_all(self) -> None:
        self.inner.wait_all()

    @property
    def bytes_moved(self) -> dict[str, int]:
        return self.inner.bytes_moved

    @property
    def jobs_started(self) -> dict[str, int]:
        return self.inner.jobs_started

    @property
    def submit_s(self) -> dict[str, float]:
        return self.inner.submit_s

    @property
    def num_failures(self) -> int:
        return self.inner.num_failures + self.injected

    @property
    def compute_wait_s(self) -> float:
        return self.inner.compute_wait_s
