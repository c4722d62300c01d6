"""The transfer engine of a tensor-parallel engine, as the CPU offload in the driver uses it.

Same two-phase API as `TransferEngine` (`submit`, `poll`, `wait`, `order_compute`, `wait_all`):
a job copies the same blocks on every rank, each rank its own KV heads over its own PCIe link.
Submitted jobs go out with the next step's plan, before its forward pass, in submit order (as
a local engine starts them at once); a poll or wait that finds jobs not sent yet (a step that
ran no forward pass) sends them first. A job has finished when every rank has said so: only
then may the driver reuse its CPU blocks (write them to NVMe, read into them).

A job that cannot start on a rank is that rank's failure (the engine stops), not a
`TransferError`: the other ranks have started it already.
"""

from __future__ import annotations

from collections.abc import Collection

from tieredkv.parallel.plan import StepPlan, StepReply
from tieredkv.parallel.ranks import Ranks
from tieredkv.transfer.engine import TransferJob


class WorkerTransfers:
    """Jobs for every rank; `block_bytes` is a block's bytes on all ranks together."""

    finishes_between_steps = False  # the ranks report finished jobs in a step's replies

    def __init__(self, ranks: Ranks, block_bytes: int) -> None:
        self.ranks = ranks
        self.block_bytes = block_bytes
        self._next_id = 0
        self._unsent: list[TransferJob] = []
        self._later: tuple[int, ...] | None = None
        self._reported: dict[int, int] = {}  # job -> ranks that saw it finish
        self._finished: list[int] = []
        self._wait_s = [0.0] * ranks.world
        self.bytes_moved = {"d2h": 0, "h2d": 0}
        self.jobs_started = {"d2h": 0, "h2d": 0}
        self.submit_s = {"d2h": 0.0, "h2d": 0.0}  # only queued here: the ranks start the jobs
        self.num_failures = 0

    def submit(self, job: TransferJob) -> int:
        assert len(job.gpu_block_ids) == len(job.cpu_block_ids), "one CPU block per GPU block"
        self._unsent.append(job)
        self._next_id += 1
        self.jobs_started[job.kind] += 1
        self.bytes_moved[job.kind] += len(job.gpu_block_ids) * self.block_bytes
        return self._next_id - 1

    def order_compute(self, later: Collection[int] = ()) -> None:
        """The next forward pass waits for the jobs submitted so far but `later` (on each rank)."""
        self._later = tuple(later)

    def plan(self, **step: object) -> StepPlan:
        """A plan carrying the jobs not sent yet (and the ordering asked for) besides `step`."""
        jobs, self._unsent = tuple(self._unsent), []
        later, self._later = self._later, None
        return StepPlan(jobs=jobs, first_job=self._next_id - len(jobs), later=later, **step)

    def record(self, replies: list[StepReply]) -> None:
        """Book what each rank saw finish."""
        for rank, reply in enumerate(replies):
            self._wait_s[rank] = reply.transfer_wait_s
            for job in reply.finished_jobs:
                self._reported[job] = self._reported.get(job, 0) + 1
                if self._reported[job] == self.ranks.world:
                    del self._reported[job]
                    self._finished.append(job)

    def poll(self) -> list[int]:
        """Jobs finished on every rank since the last call."""
        if self._unsent and self.ranks.failure is None:
            self.record(self.ranks.call("step", self.plan()))
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: list[int] | None) -> None:
        """Block until the jobs (None: all) have finished on every rank (they still come out of
        `poll`). Returns at once when the ranks have stopped: nothing will finish any more."""
        if self.ranks.failure is not None:
            return
        if self._unsent:
            self.record(self.ranks.call("step", self.plan()))
        self.record(self.ranks.call("wait", job_ids))

    def wait_all(self) -> None:
        self.wait(None)

    @property
    def compute_wait_s(self) -> float:
        """Seconds the slowest rank's forward passes stood still for transfers."""
        return max(self._wait_s)
