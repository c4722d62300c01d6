"""Which phase of its TTFT split (`tieredkv.sequence.TtftSplit`) each sequence before its first
token is in, decided at the end of each scheduling step.

Operations:
- `loading(seq_id)`: the sequence has nothing to compute this step before its KV lands, from the
  lower tier or copied in from the CPU tier.
- `mark(scheduled, seqs)`: tell each of `seqs` its phase from now on, and start the next step.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable

from tieredkv.sequence import Sequence, SequenceStatus


class PhaseMarks:
    """This step's sequences waiting for their KV to land: a scheduling fact of the step, cleared
    at its end (the load state itself is the lower tier's)."""

    def __init__(self) -> None:
        self._loading: set[str] = set()

    def loading(self, seq_id: str) -> None:
        self._loading.add(seq_id)

    def mark(self, scheduled: Collection[str], seqs: Iterable[Sequence]) -> None:
        """Prefill if scheduled, loading if it waits for its KV, preempted if swapped out or
        requeued, queued otherwise."""
        now = time.monotonic()
        for seq in seqs:
            if seq.first_token_time is not None:
                continue
            if seq.seq_id in scheduled:
                seq.ttft_split.enter("prefill", now)
            elif seq.seq_id in self._loading:
                seq.ttft_split.enter("loading", now)
            elif seq.status is SequenceStatus.SWAPPED or seq.recomputing and seq.status is SequenceStatus.WAITING:
                seq.ttft_split.enter("preempted", now)
            else:
                seq.ttft_split.enter("queued", now)
        self._loading.clear()
