"""The CPU tier's admission policy and the offline replay of a block trace (LRU, TinyLFU,
Belady) on the access pattern that breaks LRU: conversations returning in turn."""

from __future__ import annotations

from tieredkv.cache.admission import FrequencyAdmission
from tieredkv.cache.trace import BlockTrace, replay


def multi_turn_trace(users: int, turns: int, first_blocks: int, blocks_per_turn: int) -> BlockTrace:
    """Users take turns; each turn asks for the user's whole history, then offers it (and the
    turn's new blocks) as the GPU evicts it during the other users' turns."""
    trace = BlockTrace()
    history = {u: [u * 10_000 + i for i in range(first_blocks)] for u in range(users)}
    for turn in range(turns):
        for u in range(users):
            if turn:
                trace.request(tuple(history[u]))
            history[u] += [u * 10_000 + len(history[u]) + i for i in range(blocks_per_turn)]
            for block in history[u]:
                trace.offer(block)
    return trace


def test_frequency_admission_prefers_what_was_asked_for_more_and_forgets_slowly():
    admission = FrequencyAdmission(capacity_blocks=2)  # counts halve every 20 requests
    admission.record([1, 1, 1, 2])
    assert admission.admits(1, 2) and not admission.admits(2, 1) and not admission.admits(3, 2)
    assert not admission.admits(2, 2)  # a tie keeps the resident block
    admission.record([9] * 16)  # the 20th request halves every count
    assert admission.count(1) == 1 and admission.count(2) == 0 and admission.count(9) == 8


def test_replay_of_cyclic_reuse_lru_serves_nothing_tinylfu_approaches_belady():
    trace = multi_turn_trace(users=12, turns=8, first_blocks=20, blocks_per_turn=2)
    working_set = 12 * (20 + 8 * 2)
    capacity = working_set // 3
    lru, tinylfu, belady = (replay(trace, capacity, p) for p in ("lru", "tinylfu", "belady"))
    assert lru.requested_blocks == tinylfu.requested_blocks == belady.requested_blocks
    assert lru.hit_blocks == 0
    assert belady.hit_rate >= tinylfu.hit_rate > 0.5 * belady.hit_rate
    assert belady.hit_rate <= 0.5  # a third of the working set cannot serve much more


def test_replay_when_everything_fits_is_all_hits_under_every_policy():
    trace = multi_turn_trace(users=3, turns=4, first_blocks=4, blocks_per_turn=1)
    for policy in ("lru", "tinylfu", "belady"):
        result = replay(trace, 1000, policy)
        assert result.hit_blocks == result.requested_blocks > 0


def test_replay_with_no_capacity_hits_nothing():
    trace = multi_turn_trace(users=2, turns=3, first_blocks=2, blocks_per_turn=1)
    assert all(replay(trace, 0, p).hit_blocks == 0 for p in ("lru", "tinylfu", "belady"))


def test_belady_holds_the_most_requested_blocks_block_by_block():
    trace = multi_turn_trace(users=9, turns=6, first_blocks=12, blocks_per_turn=3)
    for capacity in (20, 60, 120):
        rates = {p: replay(trace, capacity, p).resident_rate for p in ("lru", "tinylfu", "belady")}
        assert rates["belady"] >= max(rates["lru"], rates["tinylfu"])
