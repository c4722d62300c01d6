"""A request as the engine tracks it: tokens, progress, state and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from tieredkv.sampling import FailedSample, SamplingParams

if TYPE_CHECKING:
    from tieredkv.text import IncrementalDetokenizer


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
    eos_token_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found cached at its first admission
    recomputing: bool = False  # preempted and requeued: its prefix hits are its own blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error")
    text_delta: str | None = None  # the text the last token added (with a detokenizer)
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

    def append_token(self, token_id: int | FailedSample) -> None:
        """Add a sampled token and finish the request if it hit a stop condition (a stop token,
        EOS, the length, a stop string in its text); a sample that failed finishes it with
        "error"."""
        if isinstance(token_id, FailedSample):
            self.error = token_id.message
            self.text_delta = None
            self.finish("error")
            return
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.token_ids.append(token_id)
        p = self.params
        if token_id in p.stop_token_ids or token_id in self.eos_token_ids and not p.ignore_eos:
            self.finish("stop")
        elif self.num_output_tokens >= p.max_tokens:
            self.finish("length")
        if self.detokenizer is not None:
            self._detokenize()

    def _detokenize(self) -> None:
        """The new text of the token just appended; a stop string in it finishes the request."""
        detok = self.detokenizer
        stop = detok.add(self.token_ids[-1], is_stop_token=self.finish_reason == "stop")
        if stop is None and self.is_finished:
            stop = detok.flush()
        if stop is not None:
            self.finish("stop")
        self.text_delta = detok.take_delta(self.is_finished)

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the next sample must not be: the stop tokens, until `min_tokens` are out."""
        if self.num_output_tokens >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return (*eos, *self.params.stop_token_ids)

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
