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


@dataclass(frozen=True)
class SampleRow:
    """One sequence that samples this step. `seed` is set the first time rank 0 must build the
    request's generator (random sampling only); later rows of the request leave it None."""

    request_id: str
    params: SamplingParams
    seed: int | None
    banned_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """What every rank does this step, in order: submit `jobs` (ids `first_job`, `first_job`+1,
    ...), order the forward pass after the transfers but those in `later` (None: no ordering
    asked), run `inputs` (None: transfers only), sample `rows` on rank 0; first drop the
    generators of the `forget` requests."""

    jobs: tuple[TransferJob, ...] = ()
    first_job: int = 0
    later: tuple[int, ...] | None = None
    inputs: StepInputs | None = None
    rows: tuple[SampleRow, ...] = ()
    forget: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepReply:
    """A rank's answer: `tokens` (rank 0, with a forward pass), the transfer jobs it saw
    finish since its last reply, and the compute time its transfers cost so far."""

    tokens: list[int | FailedSample] | None
    finished_jobs: list[int]
    transfer_wait_s: float
