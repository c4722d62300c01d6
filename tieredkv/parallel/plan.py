"""The messages between the driver and the ranks.

- `StepPlan`: the transfers submitted since the last plan, then (optionally) a forward pass and
  the rows rank 0 samples.
- `StepReply`: what a rank did: rank 0's sampled tokens, the transfers it saw finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from tieredkv.model.runner import StepInputs
from tieredkv.sampling import FailedSample, SamplingParams
from tieredkv.transfer.engine import TransferJob

REPORTED_ERROR_EXIT = 3  # a rank's exit status after it sent the driver its error


@dataclass(frozen=True)
class NewRequest:
    """A request rank 0 samples for the first time: its parameters and, for random sampling,
    the seed of its generator (kept on rank 0 until the request is forgotten)."""

    request_id: str
    params: SamplingParams
    seed: int | None


@dataclass(frozen=True)
class StepPlan:
    """What every rank does this step, in order: submit `jobs` (ids `first_job`, `first_job`+1,
    ...), order the forward pass after the transfers but those in `later` (None: no ordering
    asked), run `inputs` (None: transfers only); rank 0 then samples row i of the logits for
    request `rows[i]`, never one of the tokens `banned` lists for row i. Rank 0 first forgets
    the `forget` requests and learns the `new_requests` (a request's parameters travel once)."""

    jobs: tuple[TransferJob, ...] = ()
    first_job: int = 0
    later: tuple[int, ...] | None = None
    inputs: StepInputs | None = None
    rows: tuple[str, ...] = ()
    banned: tuple[tuple[int, tuple[int, ...]], ...] = ()
    new_requests: tuple[NewRequest, ...] = ()
    forget: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepReply:
    """A rank's answer: `tokens` (rank 0, with a forward pass), the transfer jobs it saw
    finish since its last reply, and the compute time its transfers cost so far."""

    tokens: list[int | FailedSample] | None
    finished_jobs: list[int]
    transfer_wait_s: float
