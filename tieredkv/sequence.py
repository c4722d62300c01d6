"""A request as the engine tracks it: tokens, progress, state and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tieredkv.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. `token_ids` holds the prompt followed by the generated tokens;
    `num_computed_tokens` of them have KV in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found cached at its first admission
    recomputing: bool = False  # preempted and requeued: its prefix hits are its own blocks
    status: SequenceStatus = SequenceStatus.WAITING
    prefetched: bool = False  # NVMe prefix loads considered since it last joined the queue
    load_from: int | None = None  # first token of the prefix blocks being read from NVMe
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token and finish the request if it hit a stop condition."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)
        p = self.params
        if token_id in p.stop_token_ids or token_id == self.eos_token_id and not p.ignore_eos:
            self.finish("stop")
        elif self.num_output_tokens >= p.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic()


class ScheduledSeq(NamedTuple):
    """`num_new_tokens` tokens of `seq`, from `seq.num_computed_tokens` on, run this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens
