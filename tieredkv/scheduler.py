"""Continuous batching with chunked prefill.

Each `schedule()`:
1. extend running sequences (decodes and unfinished prefill chunks), oldest first; when
   blocks run out, preempt the newest running sequence (the policy says how) and retry;
2. if nothing was preempted, admit waiting sequences in order, reusing cached prefixes,
   while the token budget (`max_num_batched_tokens`) and `max_num_seqs` allow.

The scheduler talks to blocks only through `KVCacheManager`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tieredkv.cache.manager import KVCacheManager
from tieredkv.config import SchedulerConfig
from tieredkv.policy import PreemptionPolicy
from tieredkv.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """`num_new_tokens` tokens of `seq`, from `seq.num_computed_tokens` on, run this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: PreemptionPolicy) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions: dict[str, int] = {"recompute": 0, "swap": 0}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self.kv.allocate(seq, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.kv.match_prefix(seq)
            n = min(seq.num_tokens - prefix.num_tokens(self.kv.block_size), budget)
            if self.kv.allocate(seq, n, prefix) is None:
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        kind = self.policy.decide(seq)
        self.num_preemptions[kind] += 1
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
