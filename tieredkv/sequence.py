"""A request as the engine tracks it: tokens, progress, state and timings.

A request is one `Sequence`, or several once it forks (parallel samples, beams): the forked
sequences are ordinary sequences to the scheduler, tied together by their `SequenceGroup`.

Where its time to first token went is its `TtftSplit`: the scheduler says which phase it is in
after each `schedule()`, the first token closes it, so the phases sum to the TTFT exactly.
"""

from __future__ import annotations

import copy
import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, get_args

import torch

from tieredkv.logprobs import TokenLogprobs
from tieredkv.outputs import CompletionOutput
from tieredkv.sampling import FailedSample, SamplingParams

if TYPE_CHECKING:
    from tieredkv.text import IncrementalDetokenizer

_seq_ids = itertools.count()


def _next_seq_id() -> str:
    return f"s{next(_seq_ids)}"


TtftPhase = Literal["queued", "loading", "prefill", "preempted"]
TTFT_PHASES: tuple[TtftPhase, ...] = get_args(TtftPhase)


class TtftSplit:
    """A request's time from arrival to first token, by phase: `queued` (not scheduled, for want
    of budget, blocks or slots), `loading` (its prefix arriving from a lower tier), `prefill`
    (from a step that scheduled its tokens until the next decision), `preempted` (swapped out or
    requeued for recompute). Each interval belongs to exactly one phase."""

    def __init__(self, arrival_time: float) -> None:
        self.phase: TtftPhase = "queued"
        self.since = arrival_time
        self.seconds: dict[TtftPhase, float] = dict.fromkeys(TTFT_PHASES, 0.0)
        self.closed = False

    def enter(self, phase: TtftPhase, now: float) -> None:
        """From `now` on the request is in `phase` (nothing once its first token is out)."""
        if self.closed:
            return
        self.seconds[self.phase] += now - self.since
        self.phase, self.since = phase, now

    def close(self, now: float) -> None:
        """The first token came out at `now`."""
        self.enter(self.phase, now)
        self.closed = True

    def copy(self) -> TtftSplit:
        twin = copy.copy(self)
        twin.seconds = dict(self.seconds)
        return twin


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request, or one sample or beam of a forked request (`group`). `token_ids` holds the
    prompt followed by the generated tokens; `num_computed_tokens` of them have KV in the cache.
    `seq_id` names the sequence in the KV cache manager (unique in the process); `request_id`
    is its request's."""

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
    seq_id: str = field(default_factory=_next_seq_id)
    group: SequenceGroup | None = None  # the request's sequences, once it may fork
    index: int = 0  # which sample of its request
    held: bool = False  # all computed, its next token waits for its group (a beam)
    logprobs: list[TokenLogprobs] | None = None  # per output token, with `params.logprobs`
    cumulative_logprob: float | None = None
    ttft_split: TtftSplit = field(init=False)

    def __post_init__(self) -> None:
        self.ttft_split = TtftSplit(self.arrival_time)
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

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

    @property
    def width(self) -> int:
        """How many sequences this one is about to become (its request's samples or beams
        before the first fork; 1 otherwise)."""
        return self.group.width_of(self) if self.group is not None else 1

    def fork(self) -> Sequence:
        """A copy of this sequence under a new `seq_id`, sharing no mutable state (its KV
        blocks are shared through the cache manager, its generator is set by its group)."""
        child = copy.copy(self)
        child.seq_id = _next_seq_id()
        child.generator = None
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.ttft_split = self.ttft_split.copy()
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.detokenizer = None if self.detokenizer is None else self.detokenizer.fork()
        return child

    def append_token(self, token_id: int | FailedSample, logprobs: TokenLogprobs | None = None) -> None:
        """Add a sampled token (with its logprobs, when the request asked for them) and finish
        the request if it hit a stop condition (a stop token, EOS, the length, a stop string in
        its text); a sample that failed finishes it with "error"."""
        if isinstance(token_id, FailedSample):
            self.error = token_id.message
            self.text_delta = None
            self.finish("error")
            return
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
            self.ttft_split.close(self.first_token_time)
        self.token_ids.append(token_id)
        if logprobs is not None:
            if self.logprobs is not None:
                self.logprobs.append(logprobs)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprobs[token_id].logprob
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


    def completion(self) -> CompletionOutput:
        """This sequence's output so far."""
        text = self.detokenizer.sent_text if self.detokenizer is not None else None
        return CompletionOutput(self.index, self.output_token_ids, text, self.finish_reason,
                                self.cumulative_logprob, self.logprobs)


class SequenceGroup:
    """The sequences a request forked into (`seqs[0]` is the one it started as). Subclasses
    say how many sequences it becomes, when it is finished, and what it returns."""

    def __init__(self, first: Sequence) -> None:
        self.request_id = first.request_id
        self.first = first  # the sequence the engine knows the request by
        self.seqs: list[Sequence] = [first]
        first.group = self

    def width_of(self, seq: Sequence) -> int:
        """How many sequences `seq` is about to become."""
        return 1

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    def completions(self) -> list[CompletionOutput]:
        raise NotImplementedError


class ScheduledSeq(NamedTuple):
    """`num_new_tokens` tokens of `seq`, from `seq.num_computed_tokens` on, run this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens
