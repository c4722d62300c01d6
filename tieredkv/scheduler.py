"""Continuous batching with chunked prefill.

Each `schedule()`:
1. extend running sequences (decodes and unfinished prefill chunks), oldest first; when
   blocks run out, preempt the newest running sequence (swap or recompute, as the policy
   says) and retry;
2. if nothing was preempted, swap sequences back in, oldest first;
3. if none is left swapped out, admit waiting sequences in order, reusing cached prefixes,
   while the token budget (`max_num_batched_tokens`) and `max_num_seqs` allow.
Before all that, the first waiting sequences start reading the later part of their NVMe prefix
blocks (as much as the policy says), so the reads overlap other work and the computation of
the earlier part; a prefill that reaches the loaded part jumps over it once it has arrived.

A sequence whose KV is copied in from the CPU tier this step (swap-in, promoted prefix, loaded
NVMe blocks) joins the running queue but computes from the next step on: the copy overlaps
this step's forward pass instead of stalling it.

The scheduler talks to blocks only through `KVCacheManager`.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from tieredkv.cache.manager import KVCacheManager
from tieredkv.config import SchedulerConfig
from tieredkv.policy import TierPolicy
from tieredkv.sequence import ScheduledSeq, Sequence, SequenceStatus
from tieredkv.transfer.engine import TransferError

PREFETCH_DEPTH = 8  # waiting sequences whose NVMe prefix loads start ahead of their turn


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: TierPolicy) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions: dict[str, int] = {"recompute": 0, "swap": 0}
        self.num_swap_fallbacks = 0
        # prefix blocks found on NVMe at planning, by what the cost model chose for them
        self.nvme_prefix_blocks: dict[str, int] = {"load": 0, "compute": 0}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._prefetch()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._resume_swapped(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._next_chunk(seq, budget)
            if n == 0:  # waiting for its NVMe blocks
                i += 1
                continue
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

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            try:
                if self.kv.swap_in(seq, n) is None:
                    break
            except TransferError:  # its KV did not come back: recompute it
                self.swapped.popleft()
                self.num_swap_fallbacks += 1
                self._requeue(seq)
                continue
            self.swapped.popleft()
            budget -= self._run(seq, n, out)
        return budget

    def _next_chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: up to its loaded NVMe blocks, if any, and past
        them once they have landed (0 while they are still being read)."""
        n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
        if seq.load_from is None:
            return n
        if seq.num_computed_tokens < seq.load_from:
            return min(n, seq.load_from - seq.num_computed_tokens)
        if self.kv.loading(seq):
            return 0
        self.kv.skip_loaded(seq)
        seq.load_from = None
        if self.kv.landing(seq):
            return 0
        return min(len(seq.token_ids) - seq.num_computed_tokens, budget)

    def _prefetch(self) -> None:
        for seq in itertools.islice(self.waiting, PREFETCH_DEPTH):
            self._plan_loads(seq)

    def _plan_loads(self, seq: Sequence) -> None:
        """Start reading the later part of the sequence's NVMe prefix blocks (once per stay
        in the waiting queue)."""
        if seq.prefetched:
            return
        seq.prefetched = True
        prefix = self.kv.match_prefix(seq)
        if not prefix.nvme_refs:
            return
        first = prefix.num_tokens(self.kv.block_size)
        compute = self.policy.nvme_blocks_to_compute(len(prefix.nvme_refs), first)
        self.nvme_prefix_blocks["compute"] += compute
        self.nvme_prefix_blocks["load"] += len(prefix.nvme_refs) - compute
        if compute < len(prefix.nvme_refs) and self.kv.start_loads(seq, prefix.nvme_refs[compute:]):
            seq.load_from = first + compute * self.kv.block_size

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            self._plan_loads(seq)
            if seq.load_from == 0 and self.kv.loading(seq):  # nothing to compute before its loads land
                continue
            prefix = self.kv.match_prefix(seq)
            start = prefix.num_tokens(self.kv.block_size)
            n = min(seq.num_tokens - start, budget)
            if seq.load_from is not None and self.kv.loading(seq):
                if start >= seq.load_from:  # nothing to compute before its NVMe blocks arrive
                    continue
                n = min(n, seq.load_from - start)
            if self.kv.allocate(seq, n, prefix) is None:
                return
            self.waiting.remove(seq)
            budget -= self._run(seq, n, out)

    def _run(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Move `seq` to the running queue and schedule its `n` tokens, unless its KV is still
        landing; the tokens scheduled."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if self.kv.landing(seq):
            return 0
        out.scheduled.append(ScheduledSeq(seq, n))
        return n

    def _preempt(self, seq: Sequence) -> None:
        num_blocks = len(self.kv.block_table(seq))
        kind = self.policy.preemption(seq.num_computed_tokens, num_blocks, self.kv.cpu_free_blocks())
        if kind == "swap" and self.kv.swap_out(seq):
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.num_swap_fallbacks += kind == "swap"
            kind = "recompute"
            self.kv.free(seq)
            self._requeue(seq)
        self.num_preemptions[kind] += 1

    def _requeue(self, seq: Sequence) -> None:
        """Back to the front of the waiting queue, to be prefilled again."""
        seq.num_computed_tokens = 0
        seq.recomputing = True
        seq.prefetched = False
        seq.load_from = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.kv.free(seq)
