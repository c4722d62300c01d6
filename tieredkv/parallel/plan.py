"""The messages between the driver and the ranks.

- `StepPlan`: the transfers submitted since the last plan, the copy-on-write block copies,
  then (optionally) a forward pass and what rank 0 draws from each row of its logits (`Draw`).
- `StepReply`: what a rank did: rank 0's draws (`Drawn`), the transfers it saw finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tieredkv.logprobs import TokenLogprobs
from tieredkv.model.runner import StepInputs
from tieredkv.sampling import FailedSample, SamplingParams
from tieredkv.transfer.engine import TransferJob

REPORTED_ERROR_EXIT = 3  # a rank's exit status after it sent the driver its error


@dataclass(frozen=True)
class NewRequest:
    """A request rank 0 samples for the first time: its parameters and, for random sampling,
    the seed of each sample's generator (kept on rank 0 until the request is forgotten)."""

    request_id: str
    params: SamplingParams
    seeds: tuple[int | None, ...]


@dataclass(frozen=True)
class Draw:
    """What rank 0 takes from one row of logits, as the one-rank decoder would
    (`Decoder.draws`): a token for each of the request's `samples` (sample indexes), never one
    of `banned`, with its logprob and the `num_top` most likely tokens' where `num_top` is not
    None; for a beam (`beam_top` > 0, no samples), its `beam_top` best log-probs."""

    request_id: str
    samples: tuple[int, ...]
    banned: tuple[int, ...] = ()
    num_top: int | None = None
    beam_top: int = 0


@dataclass(frozen=True)
class Drawn:
    """Rank 0's draws: a token per sample, rows in order (`logprobs` beside them, None where
    not asked, or None alone); the beam rows' best log-probs and their tokens, `[beams, k]`
    (None: no beam row)."""

    tokens: list[int | FailedSample]
    logprobs: list[TokenLogprobs | None] | None = None
    beam_top: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(frozen=True)
class StepPlan:
    """What every rank does this step, in order: submit `jobs` (ids `first_job`, `first_job`+1,
    ...), order the forward pass after the transfers but those in `later` (None: no ordering
    asked), copy block `src` to `dst` for each of `copies` (copy-on-write), run `inputs` (None:
    transfers only); rank 0 then takes `draws[i]` from row i of the logits. Rank 0 first
    forgets the `forget` requests and learns the `new_requests` (parameters travel once)."""

    jobs: tuple[TransferJob, ...] = ()
    first_job: int = 0
    later: tuple[int, ...] | None = None
    copies: tuple[tuple[int, int], ...] = ()
    inputs: StepInputs | None = None
    draws: tuple[Draw, ...] = ()
    new_requests: tuple[NewRequest, ...] = ()
    forget: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepReply:
    """A rank's answer: `drawn` (rank 0, with a forward pass), the transfer jobs it saw
    finish since its last reply, and the compute time its transfers cost so far."""

    drawn: Drawn | None
    finished_jobs: list[int]
    transfer_wait_s: float
