"""The CUDA transfer engine: D2H and H2D streams, staging buffers, events per job."""

from __future__ import annotations

import torch

from tieredkv.kernels.block_copy import gather_blocks, scatter_blocks
from tieredkv.transfer import TransferEngine, TransferJob, consecutive_runs

DEFAULT_STAGING_BYTES = 1 << 30


class CudaTransferEngine(TransferEngine):
    """Transfers overlap compute: gathers and DMAs run on side streams ordered by events."""

    def __init__(self, kv_cache: torch.Tensor, cpu_data: torch.Tensor, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        super().__init__(kv_cache, cpu_data)
        self.d2h_stream = torch.cuda.Stream(kv_cache.device)
        self.h2d_stream = torch.cuda.Stream(kv_cache.device)
        blocks = max(1, min(staging_bytes // self.block_bytes, kv_cache.shape[2]))
        shape = (blocks, *cpu_data.shape[1:])
        self.d2h_staging = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        self.h2d_staging = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        self._done: dict[int, torch.cuda.Event] = {}
        self._compute_waits: list[torch.cuda.Event] = []
        self._last_d2h: torch.cuda.Event | None = None

    def _start(self, job_id: int, job: TransferJob) -> None:
        compute = torch.cuda.current_stream(self.kv_cache.device)
        if job.kind == "d2h":
            done, gathered = self._d2h(job, compute)
            self._last_d2h = done
            # a block freed by this swap-out may be rewritten by the next forward pass: that pass
            # must wait until the gather has read it (the DMA to the host may still run on)
            self._compute_waits.append(gathered)
        else:
            done = self._h2d(job, compute)
            # the next forward pass reads these blocks: it must wait until they have landed
            self._compute_waits.append(done)
        self._done[job_id] = done

    def _chunks(self, job: TransferJob) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        n = self.d2h_staging.shape[0]
        return [
            (job.gpu_block_ids[i : i + n], job.cpu_block_ids[i : i + n])
            for i in range(0, len(job.gpu_block_ids), n)
        ]

    def _d2h(self, job: TransferJob, compute: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        gathered = torch.cuda.Event()
        done = torch.cuda.Event()
        with torch.cuda.stream(self.d2h_stream):
            # the blocks were written by forward passes queued on the compute stream: read after them
            self.d2h_stream.wait_stream(compute)
            for gpu_ids, cpu_ids in self._chunks(job):
                ids = torch.tensor(gpu_ids, dtype=torch.int64, device=self.kv_cache.device)
                staging = self.d2h_staging[: len(gpu_ids)]
                # staging is reused chunk after chunk: the same stream orders this gather after
                # the previous chunk's DMAs
                gather_blocks(self.kv_cache, ids, staging)
                gathered.record()
                for pos, first, length in consecutive_runs(cpu_ids):
                    self.cpu_data[first : first + length].copy_(staging[pos : pos + length], non_blocking=True)
            done.record()
        return done, gathered

    def _h2d(self, job: TransferJob, compute: torch.cuda.Stream) -> torch.cuda.Event:
        done = torch.cuda.Event()
        with torch.cuda.stream(self.h2d_stream):
            # the destination blocks may still be read or written by queued forward passes...
            self.h2d_stream.wait_stream(compute)
            # ...or still be read by a D2H gather (freed, then reallocated), and the source CPU
            # blocks may still be being written by a D2H DMA (a just-demoted prefix)
            if self._last_d2h is not None:
                self.h2d_stream.wait_event(self._last_d2h)
            for gpu_ids, cpu_ids in self._chunks(job):
                staging = self.h2d_staging[: len(gpu_ids)]
                for pos, first, length in consecutive_runs(cpu_ids):
                    staging[pos : pos + length].copy_(self.cpu_data[first : first + length], non_blocking=True)
                ids = torch.tensor(gpu_ids, dtype=torch.int64, device=self.kv_cache.device)
                scatter_blocks(staging, self.kv_cache, ids)
            done.record()
        return done

    def poll(self) -> list[int]:
        finished = [job_id for job_id, event in self._done.items() if event.query()]
        for job_id in finished:
            del self._done[job_id]
        return finished

    def wait(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            if job_id in self._done:
                self._done[job_id].synchronize()

    def order_compute(self) -> None:
        compute = torch.cuda.current_stream(self.kv_cache.device)
        for event in self._compute_waits:
            compute.wait_event(event)
        self._compute_waits.clear()
