"""What a new sequence brings into the GPU's reach and what it computes instead: the lower
tier's prefix blocks planned against the queues they would join, CPU hits copied in only when
that beats computing them, and the lower tier's load rate learned from the loads that landed.
The scheduler asks; the KV manager moves the blocks.

Operations:
- `pin(policy)`: plan by another policy, its cost model as given (nothing learned over it).
- `learn(computed_last_step)`: teach the observed load rate how long the loads that landed took.
- `prefetch(in_turn, backlog, to_compute)`: start the lower-tier loads of the first waiting
  sequences in the order they are to run, so that the reads overlap other work before their turn;
  on an idle tier, the first of them whose loads landed reads ahead into what it was to compute
  (its plan was made against queues it has waited longer behind).
- `plan(seq, gpu_queue_tokens)`: plan one sequence's lower-tier loads (once per stay in the
  waiting queue; the KV manager keeps the plan).
- `give_up_late(seq, gpu_queue_tokens, launch_s, num_delayed) -> bool`: a sequence found waiting
  for its reads computes those tokens instead when that is faster than waiting for the reads
  still queued, counting the other prefills that computing them delays.
- `worth_copying(prefix) -> PrefixMatch`: the prefix less the CPU hits not worth copying in;
  `admitted(found, used)` counts the CPU hits recomputed when a sequence is admitted with it.
- `stats()`: the blocks planned by choice, the late reads given up, the CPU hits recomputed,
  the learned read rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tieredkv.cache.manager import KVCacheManager, SplitPolicy
from tieredkv.cache.prefix import PrefixMatch
from tieredkv.policy import ObservedLoads, TierPolicy
from tieredkv.sequence import Sequence, SequenceStatus

PREFETCH_DEPTH = 8  # waiting sequences whose lower-tier prefix loads start ahead of their turn
READ_AHEAD_S = 0.25  # the most disk time a read-ahead takes: a newcomer's reads wait behind it


class LoadPlanner:
    """Chooses, for each admitted prefix, what to load and what to compute (TierPolicy's cost
    model at the queues of the moment) and learns the lower tier's load rate as requests see it."""

    def __init__(self, kv: KVCacheManager, policy: TierPolicy, learn_rate: bool) -> None:
        """`learn_rate`: follow the lower tier's observed load rate and latency from the
        calibrated figures on (False: a cost model pinned in the config stays as pinned)."""
        self.kv = kv
        self.policy = policy
        cost = policy.cost
        learn = learn_rate and cost is not None and cost.disk_read_bytes_per_s is not None
        self.observed_loads = ObservedLoads(cost.disk_read_bytes_per_s, cost.read_latency_s) if learn else None
        # prefix blocks found in the lower tier at planning, by what the cost model chose for them;
        # `compute_for_queues`: computed only because of the lower tier's and the GPU's queues
        self.lower_prefix_blocks: dict[str, int] = {"load": 0, "compute": 0, "compute_for_queues": 0}
        self.cpu_hits_recomputed = 0  # CPU prefix blocks recomputed: copying them in was slower
        self.read_ahead_blocks = 0  # planned to compute, loaded by a read-ahead instead
        # sequences that gave up their late reads, by where they waited: in the waiting queue, or running
        self.late_requests: dict[str, int] = {"waiting": 0, "running": 0}

    def pin(self, policy: TierPolicy) -> None:
        """Plan by `policy` from now on, its cost model as given: the learned rate is dropped."""
        self.policy, self.observed_loads = policy, None

    def learn(self, computed_last_step: set[str]) -> None:
        """Teach the observed loads how long those that landed since the last step took (with
        the reads queued ahead of them), from submission (what was learned is dropped after a
        quiet while: `ObservedLoads.age`). A sequence that computed in the last step may have
        had its loads land at any time of it: how long they took is not known, and not taught."""
        if self.observed_loads is not None:
            self.observed_loads.age(time.monotonic())
        for load in self.kv.landed_loads():
            if self.observed_loads is not None and load.request_id not in computed_last_step:
                self.observed_loads.add(load.num_blocks * self.policy.block_bytes, load.seconds)

    def prefetch(self, in_turn: Iterable[Sequence], backlog: int, to_compute: Callable[[Sequence], int]) -> None:
        """Plan the loads of the first `PREFETCH_DEPTH` waiting sequences of `in_turn` (the
        sequences in the order they are to run: the waiting queue, or the policy's ranking),
        each behind the prefill of `backlog` tokens and of the sequences before it (`to_compute(seq)`:
        its tokens left less its resident prefix, which it will not compute, asked only when a
        plan is made behind it). Planned against the queue a sequence will really be behind,
        a load is not planned where computing would have been faster once its turn came."""
        ahead: list[Sequence] = []
        planned = 0
        read_ahead = self._read_ahead_blocks()
        for seq in in_turn:
            if planned == PREFETCH_DEPTH:
                return
            if seq.status is SequenceStatus.WAITING:
                def queue(ahead: tuple[Sequence, ...] = tuple(ahead)) -> int:
                    return backlog + sum(map(to_compute, ahead))

                self._plan(seq, queue)
                if read_ahead:  # the first in turn whose loads landed, while the tier is idle
                    self.read_ahead_blocks += self.kv.read_ahead(seq, self._split(queue), read_ahead)
                planned += 1
            ahead.append(seq)

    def _read_ahead_blocks(self) -> int:
        """The blocks the lower tier reads in `READ_AHEAD_S` (0: no read rate, loads are not split)."""
        cost, observed = self.policy.cost, self.observed_loads
        rate = observed.bytes_per_s if observed is not None else cost and cost.disk_read_bytes_per_s
        return int(READ_AHEAD_S * rate / self.policy.block_bytes) if rate else 0

    def plan(self, seq: Sequence, gpu_queue_tokens: int) -> None:
        """Plan the sequence's lower-tier prefix loads against the tier's and the GPU's queues:
        the reads already in flight, and `gpu_queue_tokens` of prefill ahead of it."""
        self._plan(seq, lambda: gpu_queue_tokens)

    def _split(self, gpu_queue_tokens: Callable[[], int]) -> SplitPolicy:
        """The policy's split of a lower-tier run behind the tier's reads in flight and
        `gpu_queue_tokens()` of prefill (asked only when a split is made)."""
        def split(num_blocks: int, first_token: int) -> int:
            queued, plan = self.kv.lower_reads_in_flight(), self.policy.lower_blocks_to_compute
            return plan(num_blocks, first_token, queued, gpu_queue_tokens(), self.observed_loads)
        return split

    def _plan(self, seq: Sequence, gpu_queue_tokens: Callable[[], int]) -> None:
        behind_queues = self._split(gpu_queue_tokens)

        def split(num_blocks: int, first_token: int) -> int:  # called only when a plan is made
            compute = behind_queues(num_blocks, first_token)
            idle = self.policy.lower_blocks_to_compute(num_blocks, first_token, observed=self.observed_loads)
            self.lower_prefix_blocks["compute_for_queues"] += max(0, compute - idle)
            return compute

        plan = self.kv.plan_loads(seq, split)
        if plan is None:
            return
        self.lower_prefix_blocks["compute"] += plan.num_compute
        self.lower_prefix_blocks["load"] += plan.num_load

    def give_up_late(self, seq: Sequence, gpu_queue_tokens: int, launch_s: float = 0.0, num_delayed: int = 0) -> bool:
        """If the sequence waits for reads still in flight (found with nothing to compute before
        they land) and computing their blocks behind `gpu_queue_tokens` of prefill is faster
        than the reads queued up to its last one (and the `launch_s` the loop then takes to
        make its next chunk), counting the `num_delayed` other sequences with prefill that
        computing them delays as much, it stops waiting and computes them; whether it did. A
        plan made behind a queue it then jumped (ranked ahead), or against a rate the tier no
        longer reads at, is corrected here."""
        late = self.kv.late_reads(seq)
        if late is None:
            return False
        first_token = late.load_from + late.num_landed * self.policy.block_size
        if self.policy.wait_for_reads(late.num_blocks, first_token, late.queued, gpu_queue_tokens, self.observed_loads,
                                      launch_s, num_delayed):
            return False
        self.late_requests["waiting" if seq.status is SequenceStatus.WAITING else "running"] += 1
        self.kv.give_up_reads(seq)
        return True

    def worth_copying(self, prefix: PrefixMatch) -> PrefixMatch:
        """The prefix without its CPU hits (and what follows them) when the PCIe queue makes
        recomputing them faster than copying them in."""
        if not prefix.cpu_blocks:
            return prefix
        first = len(prefix.gpu_blocks) * self.kv.block_size
        if self.policy.promote(len(prefix.cpu_blocks), first, self.kv.h2d_queue_blocks()):
            return prefix
        return PrefixMatch(prefix.gpu_blocks)

    def admitted(self, found: PrefixMatch, used: PrefixMatch) -> None:
        """A sequence was admitted with `used` of the prefix `found`: count the CPU hits it
        recomputes instead."""
        self.cpu_hits_recomputed += len(found.cpu_blocks) - len(used.cpu_blocks)

    def stats(self) -> dict[str, object]:
        """`nvme_prefix_blocks` (by choice), `nvme_read_ahead_blocks` (planned to compute, then
        loaded), `nvme_late_requests` (the sequences that computed their late reads' blocks, by
        where they waited), `cpu_hits_recomputed`, and the lower
        tier's learned read rate (`disk_read_bytes_per_s`) when it is followed."""
        stats: dict[str, object] = {
            "nvme_prefix_blocks": dict(self.lower_prefix_blocks),
            "nvme_late_requests": dict(self.late_requests),
            "cpu_hits_recomputed": self.cpu_hits_recomputed,
            "nvme_read_ahead_blocks": self.read_ahead_blocks,
        }
        if self.observed_loads is not None:
            stats["disk_read_bytes_per_s"] = self.observed_loads.bytes_per_s
        return stats
