"""What the scheduler's prefills are ranked by (`scheduling_policy` `ttft`, `hrrn`): how long each
sequence has waited, counted in tokens of work scheduled since it arrived, and how many tokens
it has left to bring onto the GPU, a waiting one's resident prefix (GPU and CPU tiers) counting as
computed. Prefix blocks loaded from the lower tier count as left: a sequence is ranked as it would
be without that tier (ranked by its computing part alone, it jumped the prefills its loads were
planned behind, then waited for the reads while they waited behind it: BENCHMARKS.md, "Loads do
not jump the queue"). The GPU queue counts its computing part alone (`to_compute`).
The policy's maths over those numbers is `tieredkv.scheduling`.

Operations:
- `arrived(seq_id)` / `forked(parent_id, child_id)` / `forget(seq_id)`: a sequence's wait starts
  (a fork has waited as long as its parent), and ends.
- `scheduled(num_tokens)`: a step's tokens were computed: the clock of waits.
- `admitted(seq_id)`: a waiting sequence was admitted: its resident prefix is not needed any more;
  `rematch_oldest(keep)`: forget the oldest resident prefix (not of `keep`), matched again when next
  asked for: one a step, as matching costs.
- `share(seqs, budget, ride_cost) -> PrefillShares`: the sequences ranked, with their shares of
  `budget`; `to_compute(seq)`: the tokens it gives the GPU to compute (less a waiting one's
  resident prefix, and its loads).
"""

from __future__ import annotations

from collections.abc import Collection

from tieredkv.cache.manager import KVCacheManager
from tieredkv.config import SchedulerConfig
from tieredkv.policy import CostModel
from tieredkv.scheduling import PrefillCandidate, PrefillShares
from tieredkv.sequence import Sequence, SequenceStatus


class PrefillRanking:
    """Each sequence's wait and, for waiting ones, its resident prefix as last matched."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        # waits (`ttft` aging, `hrrn` ratios): tokens scheduled so far, and that count when each sequence arrived
        self.num_scheduled_tokens = 0
        self._arrived_at: dict[str, int] = {}
        # `ttft`: resident prefix tokens of waiting sequences as last matched, oldest match first
        self._resident_tokens: dict[str, int] = {}

    def arrived(self, seq_id: str) -> None:
        self._arrived_at[seq_id] = self.num_scheduled_tokens

    def forked(self, parent_id: str, child_id: str) -> None:
        self._arrived_at[child_id] = self._arrived_at.get(parent_id, self.num_scheduled_tokens)

    def forget(self, seq_id: str) -> None:
        self._arrived_at.pop(seq_id, None)
        self._resident_tokens.pop(seq_id, None)

    def scheduled(self, num_tokens: int) -> None:
        self.num_scheduled_tokens += num_tokens

    def admitted(self, seq_id: str) -> None:
        self._resident_tokens.pop(seq_id, None)

    def rematch_oldest(self, keep: Collection[str]) -> None:
        """Forget the oldest resident prefix not of `keep`: it is matched again when next asked for."""
        stale = next((k for k in self._resident_tokens if k not in keep), None)
        if stale is not None:
            del self._resident_tokens[stale]

    def share(self, seqs: list[Sequence], budget: float, ride_cost: CostModel | None) -> PrefillShares:
        """`seqs` in the policy's order with their shares of `budget`; `ride_cost`: the cost
        model when decodes run in this step (each prefill chunk is then charged for its
        attention, as it says), else None."""
        candidates = []
        for seq in seqs:
            # the tokens before its next chunk (a waiting one's resident prefix); a swapped-out
            # decode is charged as the running ones are, one token (its attention is not a prefill's)
            computed = self._resident(seq) if seq.status is SequenceStatus.WAITING else seq.num_computed_tokens
            left = seq.num_tokens - computed
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                computed = 0
            candidates.append(PrefillCandidate(left, self._waited(seq), computed))
        attention = _attention_weight(ride_cost)
        config = self.config
        return PrefillShares(candidates, budget, config.prefill_aging, config.scheduling_policy,
                             config.max_prefill_chunk_tokens, attention)

    def to_compute(self, seq: Sequence) -> int:
        """Tokens the sequence has left to compute, less what its lower-tier loads bring (the
        GPU queue that later loads are planned against): for a waiting one, less the prefix
        found resident (GPU and CPU tiers) when it was last matched too; for a running one, from
        its computed tokens on."""
        if seq.status is not SequenceStatus.WAITING:
            return seq.num_tokens - seq.num_computed_tokens - self.kv.tokens_to_load(seq)
        resident = self._resident(seq)
        # loads that landed in the CPU tier before admission are resident too: counted once
        return seq.num_tokens - resident - self.kv.tokens_to_load(seq, have=resident)

    def _resident(self, seq: Sequence) -> int:
        """A waiting sequence's prefix tokens resident in the GPU and CPU tiers, as last matched."""
        resident = self._resident_tokens.get(seq.seq_id)
        if resident is None:
            resident = self._resident_tokens[seq.seq_id] = self.kv.resident_tokens(seq)
        return resident

    def _waited(self, seq: Sequence) -> int:
        """Tokens scheduled (for anyone) since the sequence arrived."""
        return self.num_scheduled_tokens - self._arrived_at.get(seq.seq_id, self.num_scheduled_tokens)


def _attention_weight(cost: CostModel | None) -> float:
    """b/a of the cost model's prefill time a*N + b*N^2 (0 without a cost model)."""
    if cost is None or cost.prefill_s_per_token <= 0:
        return 0.0
    return cost.prefill_s_per_token_sq / cost.prefill_s_per_token
