"""Continuous batching with chunked prefill. The scheduler owns every sequence's progress.

Each `schedule()`:
1. extend running sequences (decodes and unfinished prefill chunks), oldest first; when
   blocks run out, preempt the newest running sequence (swap or recompute, as the policy
   says) and retry;
2. if nothing was preempted, swap sequences back in, oldest first;
3. if none is left swapped out, admit waiting sequences in order, reusing cached prefixes,
   while the token budget (`max_num_batched_tokens`) and `max_num_seqs` allow.
That is `scheduling_policy: fcfs`. With `ttft` or `hrrn` (`tieredkv.scheduling`), step 1 takes the decodes
only, and instead of steps 2 and 3 the partly-prefilled, the swapped-out and the waiting
sequences share what is left of the budget in the policy's order (`_schedule_prefills`): what
ranks them (waits, tokens left) is `PrefillRanking`'s (`tieredkv.prefill_ranking`). A swapped-out
sequence comes back in its turn, so one preempted for ranking last does not hold every shorter
prompt behind the blocks it needs.
The first waiting sequences in the order they are to run (the queue's for `fcfs`, else the
ranking's) start reading the later part of their prefix blocks found in the lower tier (disk,
remote; as much as the policy says, behind the prefill ahead of them), so the reads overlap other
work and the computation of the earlier part: what to load and what to compute is
`LoadPlanner`'s choice (`tieredkv.load_planning`), made again for one kept waiting once the tier
is idle (a read-ahead). The load state is the lower tier's: how far a
sequence may compute is the KV manager's answer (`computable`, after `land_loads` has jumped a
running one over what its loads brought; while another sequence decodes, one whose loads are in
waits for room for the rest of its prompt rather than push out the prefills ranked after it),
and whether a waiting sequence still waits for its loads too (`load_wait`). A sequence that
reaches blocks still being read waits for them unless computing them is faster, behind the
prefill the GPU was given and has not finished (the loop runs ahead of the GPU through steps
that sample nothing: `LaunchedPrefill`), and counting the other prefills that computing them
would delay; while a running one waits and the GPU is busy, the prefills after it (ranked after
it, or under `fcfs` running or admitted after it) wait too, so that their chunks do not run
ahead of its own.

After the forward pass, `update(batch, sampled_tokens)` advances the scheduled sequences,
commits their new full blocks, appends the sampled tokens and retires finished sequences (in
two halves, `advance(batch)` and `append(seqs, tokens)`, when sequences fork in between).

Forks (parallel samples, beams): `fork(parent, n)` puts n copies of a sequence, sharing its
blocks, next to it in its queue; from then on they are ordinary sequences. A beam whose next
token waits for its siblings is `held` (`hold(seq)`): it is not swapped in or admitted while
held, and when nothing else can run for want of blocks or sequence slots, the newest held
running sequence is preempted, so that a beam's siblings are never locked out by beams that
only wait.

A sequence whose KV is copied in from the CPU tier this step (swap-in, promoted prefix, loaded
lower-tier blocks) joins the running queue but computes from the next step on: the copy overlaps
this step's forward pass instead of stalling it. At the end of each step, each sequence before its
first token is told its TTFT phase (`PhaseMarks`, `tieredkv.ttft_phases`).

The scheduler talks to blocks only through `KVCacheManager`.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from tieredkv.cache.manager import Allocation, KVCacheManager, KVLost, LoadWait
from tieredkv.config import SchedulerConfig
from tieredkv.launched_prefill import GpuQueue
from tieredkv.load_planning import LoadPlanner
from tieredkv.logprobs import TokenLogprobs
from tieredkv.policy import TierPolicy
from tieredkv.prefill_ranking import PrefillRanking
from tieredkv.sampling import FailedSample
from tieredkv.sequence import ScheduledSeq, Sequence, SequenceStatus
from tieredkv.ttft_phases import PhaseMarks

# what holds a waiting or swapped-out sequence back in a step of `ttft`, `hrrn` (`Scheduler.held_back`):
# the step's token budget went to the prefills ranked ahead of it; one ahead could not get GPU blocks
# or a sequence slot; a sequence was preempted this step; one ahead waits for room for the rest of its
# prompt, its loads in; one ahead waits for its loads to land while the GPU computes prefill
HELD_BACK = ("budget", "blocks", "slots", "preempted", "room_for_loads", "loads_landing")


@dataclass
class SchedulerOutput:
    """One step's plan: the chunks to run, the sequences preempted to make room, and the
    sequences whose chunk reaches their end, so that they get a token (in batch order)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting, running and swapped queues and every sequence's progress."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: TierPolicy,
                 launched: GpuQueue | None = None) -> None:
        """`policy`: the cost model's choices (swap or recompute, load or compute); the load
        planner holds it, and learns the lower tier's rate over it unless the config pins one.
        `launched`: the prefill the GPU was given and has not finished, ahead of whatever a
        sequence computes now, and the loop's launch time (none: the loop waits for each step)."""
        self.config = config
        self.kv = kv
        self.launched = launched
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions: dict[str, int] = {"recompute": 0, "swap": 0}
        self.preempted_tokens: dict[str, int] = {"recompute": 0, "swap": 0}  # computed tokens they held
        self.recomputed_for_cpu_room = 0  # preemptions that would have swapped but the CPU tier had no room
        self.num_swap_fallbacks = 0
        # `ttft`, `hrrn`: waiting or swapped-out sequences a step left where they were, by what held
        # them back (`HELD_BACK`), summed over steps
        self.held_back: Counter[str] = Counter()
        # what new sequences load and compute; a cost model pinned in the config stays as pinned
        self.loads = LoadPlanner(kv, policy, learn_rate=config.cost_model is None)
        self._last_scheduled: set[str] = set()  # the sequences that computed in the last step
        self.loaded_skipped_tokens = 0  # prefill tokens jumped over: their KV came from the lower tier
        self.load_waits = 0  # steps a sequence had nothing to compute before its loads landed, or had room
        self._decoding = False  # this step: a running sequence is past its prompt
        self._room_waits: set[str] = set()  # this step: sequences whose loads are in, waiting for room for them
        self.ranking = PrefillRanking(config, kv)  # `ttft`, `hrrn`: waits and prefixes left
        self.phases = PhaseMarks()  # this step's phase marks for the TTFT split

    @property
    def policy(self) -> TierPolicy:
        return self.loads.policy

    @policy.setter
    def policy(self, policy: TierPolicy) -> None:
        """Follow `policy` from now on, its cost model as given (no learned load rate)."""
        self.loads.pin(policy)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.ranking.arrived(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.loads.learn(self._last_scheduled)
        ranked = self.config.scheduling_policy != "fcfs"
        if self.waiting and not ranked:  # (ranked: in the ranking's order, `_schedule_prefills`)
            self.loads.prefetch(self.waiting, self._prefill_backlog(), self.ranking.to_compute)
        prefilling: list[Sequence] | None = [] if ranked else None  # decodes first, prefills later
        # a running sequence past its prompt gives its blocks back when it finishes, unasked
        self._decoding = any(s.num_computed_tokens >= s.num_prompt_tokens for s in self.running)
        self._room_waits.clear()
        budget, held = self._schedule_running(out, self.config.max_num_batched_tokens, prefilling)
        blocked = False
        if prefilling is not None:  # swapped sequences take their turn in the policy's order
            blocked = self._schedule_prefills(out, budget, prefilling)
        else:
            if not out.preempted:
                budget, blocked = self._resume_swapped(out, budget)
            if not out.preempted and not held and not self._swapped_ready():
                blocked = self._admit_waiting(out, budget)
        if blocked and not out.scheduled and not out.preempted:
            self._preempt_held(out)
        out.sampling = [s.seq for s in out.scheduled if s.samples]
        self._last_scheduled = {s.seq.seq_id for s in out.scheduled}
        self.phases.mark(self._last_scheduled, itertools.chain(self.running, self.waiting, self.swapped))
        return out

    def update(self, batch: SchedulerOutput, sampled_tokens: list[int]) -> list[Sequence]:
        """Book a finished forward pass: the scheduled tokens are computed (their full blocks
        join the prefix cache), each sampling sequence gets its token; returns the sequences
        that finished (their blocks are freed)."""
        self.advance(batch)
        return self.append(batch.sampling, sampled_tokens)

    def advance(self, batch: SchedulerOutput) -> None:
        """The scheduled tokens are computed: their full blocks join the prefix cache."""
        for item in batch.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(item.seq)
        self.ranking.scheduled(batch.num_tokens)

    def append(self, seqs: list[Sequence], tokens: list[int | FailedSample],
               logprobs: list[TokenLogprobs | None] | None = None) -> list[Sequence]:
        """Give each sequence its next token (and its logprobs); returns the sequences that
        finished (their blocks are freed)."""
        finished = []
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            seq.held = False
            seq.append_token(token, logprobs[i] if logprobs is not None else None)
            if seq.is_finished:
                self._retire(seq)
                finished.append(seq)
        return finished

    def fork(self, parent: Sequence, count: int) -> list[Sequence]:
        """`count` copies of `parent`, sharing its blocks, placed right after it in its queue."""
        children = [parent.fork() for _ in range(count)]
        for child in children:
            self.kv.fork(parent, child)
            self.ranking.forked(parent.seq_id, child.seq_id)
        queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
                 SequenceStatus.SWAPPED: self.swapped}[parent.status]
        at = queue.index(parent) + 1
        for child in reversed(children):
            queue.insert(at, child)
        return children

    def hold(self, seq: Sequence) -> None:
        """`seq` computed all its tokens and its next one waits for its group (a beam)."""
        seq.held = True

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          prefilling: list[Sequence] | None = None) -> tuple[int, bool]:
        """Schedule the running sequences, oldest first; with `prefilling`, only the decodes,
        collecting the prefills there (those the loop reaches: with no budget left they would
        get nothing). The budget left, and whether a prefill waits for its KV while the GPU
        still computes prefill: the prefills after it then wait too (their chunks would run
        ahead of its own on the GPU), decodes go on."""
        i, held = 0, False
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            prefill = seq.num_tokens - seq.num_computed_tokens > 1
            if prefill and prefilling is not None:  # scheduled later, in the policy's order
                prefilling.append(seq)
                i += 1
                continue
            if prefill and held:  # after one that waits for its KV while the GPU computes
                i += 1
                continue
            n = self._next_chunk(seq, budget)
            if n == 0:  # waiting for its lower-tier blocks, for them to land, or for room for them
                self._wait_for_loads(seq)
                held = held or self._gpu_busy() or seq.seq_id in self._room_waits
                i += 1
                continue
            while self.kv.allocate(seq, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget, held
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget, held

    def _next_chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens a running sequence computes this step, after jumping over the prefix tokens
        its lower-tier loads brought (0 while their copy to the GPU lands, or while they are
        read, unless computing them is faster: `LoadPlanner.give_up_late`). Once they are in,
        it waits (0) for room for the rest of its prompt while another sequence decodes (its
        blocks come back then), rather than push out the prefills ranked after it; none after
        it is admitted meanwhile (`_room_waits`)."""
        skipped, landing, short = self.kv.land_loads(seq, wait_for_room=self._decoding)
        if short:
            self._room_waits.add(seq.seq_id)
            return 0
        if skipped:
            seq.num_computed_tokens += skipped
            self.loaded_skipped_tokens += skipped
            if not seq.recomputing:
                seq.num_cached_tokens += skipped
        if landing:
            return 0
        n = self.kv.computable(seq, budget)
        # its turn came before its reads landed: it computes their blocks if that is faster,
        # behind the chunks before them that the GPU may still be computing
        if n == 0 and self.loads.give_up_late(seq, *self._gpu_queue(budget), self._prefills_beside(seq)):
            return self._next_chunk(seq, budget)  # it jumps over those that did, and computes on
        return n

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """`fcfs`: swap sequences back in, oldest first (held ones wait); the budget left, and
        whether one could not come back for want of blocks or sequence slots."""
        for seq in [s for s in self.swapped if not s.held]:
            if budget <= 0:
                return budget, False
            if len(self.running) >= self.config.max_num_seqs:
                return budget, True
            got = self._swap_in(out, seq, budget)
            if got is None:
                return budget, True
            budget -= got
        return budget, False

    def _swap_in(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int | None:
        """Copy a swapped sequence's KV back and schedule up to `budget` of its tokens; the
        tokens scheduled (0: its KV did not come back and it waits to be recomputed), None if
        the GPU pool is short."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        got = self.kv.swap_in(seq, n)
        if got is None:
            return None
        self.swapped.remove(seq)
        if isinstance(got, KVLost):
            self.num_swap_fallbacks += 1
            self._requeue(seq)
            return 0
        return self._run(seq, n, got, out)

    def _prefill_backlog(self) -> int:
        """Prefill tokens the running sequences still have to compute (not what loads bring)."""
        return sum(self.ranking.to_compute(s) for s in self.running if s.num_computed_tokens < s.num_prompt_tokens)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> bool:
        """Admit waiting sequences in order (held ones wait); whether one could not be admitted
        for want of blocks or sequence slots."""
        if not self.waiting:
            return False
        backlog = self._prefill_backlog()  # for sequences beyond the prefetch depth
        slots = self._slots_taken()
        for seq in list(self.waiting):
            if seq.held:
                continue
            if budget <= 0:
                return False
            if slots + seq.width > self.config.max_num_seqs:
                return True
            if self._load_wait(seq, backlog) is LoadWait.ARRIVING:
                continue
            n = self._admit(out, seq, budget, backlog)
            if n is None:
                return True
            budget -= n
            slots += seq.width
        return False

    def _gpu_busy(self) -> bool:
        """Whether the GPU is still computing prefill it was given."""
        return self.launched is not None and self.launched.tokens() > 0

    def _gpu_queue(self, launching: int) -> tuple[int, float]:
        """The prefill tokens the GPU was given and has not finished, and the loop's time to
        make a chunk of `launching` tokens, up to its launch."""
        if self.launched is None:
            return 0, 0.0
        return self.launched.tokens(), self.launched.launch_s(launching)

    def _prefills_beside(self, seq: Sequence) -> int:
        """The other sequences with prefill to compute: waiting ones (not held) and running
        ones not past their prompt."""
        waiting = sum(1 for s in self.waiting if s is not seq and not s.held)
        return waiting + sum(1 for s in self.running if s is not seq and s.num_computed_tokens < s.num_prompt_tokens)

    def _slots_taken(self) -> int:
        """Sequence slots the running sequences hold: a request not forked yet holds its width."""
        return sum(seq.width for seq in self.running)

    def _load_wait(self, seq: Sequence, backlog: int) -> LoadWait:
        """Whether a waiting sequence found with nothing to compute before its loads land still
        waits for them (it is not matched again until they have, or until computing their
        blocks behind the `backlog` of prefill is faster); a step waited is counted."""
        wait = self.kv.load_wait(seq)
        if wait is LoadWait.ARRIVING:
            in_flight, launch_s = self._gpu_queue(self.config.max_num_batched_tokens)
            if self.loads.give_up_late(seq, backlog + in_flight, launch_s, self._prefills_beside(seq)):
                wait = self.kv.load_wait(seq)  # landed: matched again
        if wait is LoadWait.ARRIVING:
            self._wait_for_loads(seq)
        return wait

    def _swapped_ready(self) -> bool:
        """Whether a swapped-out sequence is left that is not held (waiting ones come after it)."""
        return any(not s.held for s in self.swapped)

    def _admit(self, out: SchedulerOutput, seq: Sequence, budget: int, backlog: int) -> int | None:
        """Admit a waiting sequence with up to `budget` tokens, reusing its cached prefix (less
        the CPU hits not worth copying in); the tokens scheduled (0: it waits for its lower-tier
        blocks, or its KV is landing), None if the GPU pool is short."""
        self.loads.plan(seq, backlog)
        found = self.kv.match_prefix(seq)
        prefix = self.loads.worth_copying(found)
        n = self.kv.computable(seq, budget, prefix)
        if n == 0:  # nothing to compute before its lower-tier blocks arrive (`load_wait` tells when)
            self._wait_for_loads(seq)
            return 0
        got = self.kv.allocate(seq, n, prefix)
        if got is None:
            return None
        self.waiting.remove(seq)
        self.ranking.admitted(seq.seq_id)
        self.loads.admitted(found, prefix)
        seq.num_computed_tokens = got.num_cached_tokens
        if not seq.recomputing:  # a client's prompt hit, not its own blocks found again
            seq.num_cached_tokens = got.num_cached_tokens
        if got.landing:  # its prefix is copied in from the CPU tier this step
            self.phases.loading(seq.seq_id)
        return self._run(seq, n, got, out)

    def _schedule_prefills(self, out: SchedulerOutput, budget: float, prefilling: list[Sequence]) -> bool:
        """`ttft`, `hrrn`: the running sequences still prefilling and, unless a sequence was
        preempted, the swapped-out and waiting ones (not held, not waiting for their loads)
        share `budget` in the policy's order, each chunk charged for its attention
        (`chunk_cost`) where the cost model says what that is; a swapped sequence's KV copied
        back counts as computed. Whether a sequence could not run for want of blocks or
        sequence slots (none ranked after it is admitted then)."""
        hold = "preempted" if out.preempted else None  # what stops admissions this step, if anything
        backlog = self._prefill_backlog() if hold is None else 0
        waiting = self._prefill_candidates(backlog) if hold is None else []
        # what the step may leave where it is (`held_back`): the candidates; after a preemption,
        # every waiting and swapped-out sequence not held
        left = waiting if hold is None else [s for s in itertools.chain(self.swapped, self.waiting) if not s.held]
        seqs = prefilling + waiting
        if not seqs:
            self._count_held_back(left, hold or "budget")
            return False
        shares = self.ranking.share(seqs, max(budget, 0), ride_cost=self.policy.cost if out.scheduled else None)
        if hold is None:  # loads planned behind the prefills ranked ahead of them, which run first
            self.loads.prefetch((seqs[i] for i in shares.order), 0, self.ranking.to_compute)
        if budget <= 0:
            self._count_held_back(left, hold or "budget")
            return False
        slots = self._slots_taken()  # an upper bound once a preemption frees some
        blocked = False
        for i, tokens in shares:
            seq, got = seqs[i], 0
            if i < len(prefilling):
                if seq.status is SequenceStatus.RUNNING:  # not preempted for a sequence ahead
                    lower = [seqs[j] for j in shares.ranked_after() if j < len(prefilling)]
                    got = self._extend_prefill(out, seq, tokens, lower)
                    # none is admitted after one waiting for room for its loads: it would starve
                    if hold is None and (out.preempted or seq.seq_id in self._room_waits):
                        hold = "preempted" if out.preempted else "room_for_loads"
                    if got == 0 and tokens and self._gpu_busy():
                        hold = hold or "loads_landing"
                        break  # it waits for its KV while the GPU computes: the prefills after it wait too
            elif hold is None and tokens:
                if slots + seq.width > self.config.max_num_seqs:
                    got, hold = None, "slots"  # none after it is admitted either (it would starve)
                elif seq.status is SequenceStatus.SWAPPED:
                    got = self._swap_in(out, seq, tokens)
                else:
                    got = self._admit(out, seq, tokens, backlog)
                if got is None:
                    hold = hold or "blocks"
                else:
                    slots += seq.width
            blocked = blocked or got is None
            shares.took(got or 0)
        self._count_held_back(left, hold or "budget")
        return blocked

    def _count_held_back(self, candidates: list[Sequence], hold: str) -> None:
        """Count the candidates (waiting, swapped out) this step left where they were, as held by
        `hold` (`HELD_BACK`)."""
        left = sum(1 for s in candidates if s.status is not SequenceStatus.RUNNING)
        if left:
            self.held_back[hold] += left

    def _prefill_candidates(self, backlog: int) -> list[Sequence]:
        """`ttft`, `hrrn`: the swapped-out sequences that may come back (not held), then the
        waiting ones that may be admitted (not held, not waiting for their loads). One waiting
        sequence is matched again this step, the longest unmatched, unless its loads just
        landed (admitting it matches it again anyway)."""
        waiting, landed = [s for s in self.swapped if not s.held], set()
        for seq in self.waiting:
            if seq.held:
                continue
            wait = self._load_wait(seq, backlog)
            if wait is LoadWait.ARRIVING:
                continue
            waiting.append(seq)
            if wait is LoadWait.LANDED:
                landed.add(seq.seq_id)
        if waiting:
            self.ranking.rematch_oldest(keep=landed)
        return waiting

    def _extend_prefill(self, out: SchedulerOutput, seq: Sequence, share: int, lower: list[Sequence]) -> int | None:
        """Schedule up to `share` tokens of a running sequence's prefill; while blocks are short,
        preempt the last of `lower` (running prefills ranked after it) that is still running.
        The tokens scheduled (0: it waits for its lower-tier blocks), None if blocks stay short."""
        if share == 0:
            return 0
        n = self._next_chunk(seq, share)
        if n == 0:  # waiting for its lower-tier blocks, for them to land, or for room for them
            self._wait_for_loads(seq)
            return 0
        while self.kv.allocate(seq, n) is None:
            while lower and lower[-1].status is not SequenceStatus.RUNNING:
                lower.pop()
            if not lower:
                return None
            victim = lower.pop()
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
        out.scheduled.append(ScheduledSeq(seq, n))
        return n

    def _wait_for_loads(self, seq: Sequence) -> None:
        """`seq` has nothing to compute this step before its KV lands from a lower tier."""
        self.load_waits += 1
        self.phases.loading(seq.seq_id)

    def _run(self, seq: Sequence, n: int, got: Allocation, out: SchedulerOutput) -> int:
        """Move `seq` to the running queue and schedule its `n` tokens, unless its KV is still
        landing; the tokens scheduled."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if got.landing:
            return 0
        out.scheduled.append(ScheduledSeq(seq, n))
        return n

    def _preempt(self, seq: Sequence) -> None:
        num_blocks = self.kv.blocks_needed(seq.num_computed_tokens)
        cpu_free = self.kv.cpu_free_blocks()
        kind = self.policy.preemption(seq.num_computed_tokens, num_blocks, cpu_free)
        if kind == "recompute" and num_blocks > cpu_free \
                and self.policy.preemption(seq.num_computed_tokens, num_blocks, num_blocks) == "swap":
            self.recomputed_for_cpu_room += 1  # it would have swapped, had the CPU tier had room
        if kind == "swap" and self.kv.swap_out(seq):
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.num_swap_fallbacks += kind == "swap"
            kind = "recompute"
            self.kv.free(seq)
        self.num_preemptions[kind] += 1
        self.preempted_tokens[kind] += seq.num_computed_tokens
        if kind == "recompute":
            self._requeue(seq)

    def _preempt_held(self, out: SchedulerOutput) -> None:
        """Nothing could run: make room by preempting the newest held running sequence, if any
        (its next token waits for siblings that wait for blocks or slots)."""
        held = [s for s in self.running if s.held]
        if held:
            self.running.remove(held[-1])
            self._preempt(held[-1])
            out.preempted.append(held[-1])

    def _requeue(self, seq: Sequence) -> None:
        """Back to the front of the waiting queue, to be prefilled again."""
        seq.num_computed_tokens = 0
        seq.recomputing = True
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence wherever it is and free its blocks."""
        seq.finish("abort")
        self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        """Drop a finished sequence from the queues and free its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.ranking.forget(seq.seq_id)
        self.kv.free(seq)
