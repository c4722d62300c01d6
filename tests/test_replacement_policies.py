"""The replacement policies that choose their victims (ARC, adaptive W-TinyLFU): exact eviction
orders on small hand-built sequences, ARC's target moving toward the ghost list that was asked
for, W-TinyLFU's window admitting what its filter turns away from main and its window share
hill-climbed on the hit rate; and their offline replay."""

from __future__ import annotations

import pytest

from tieredkv.cache.trace import BlockTrace, replay
from tieredkv.replacement_policies import (
    ARC,
    SAMPLE_PER_BLOCK,
    STEP_DECAY,
    WINDOW_STEP,
    WTinyLFU,
    make_replacement,
    request,
)


def test_arc_evicts_recency_list_first_and_p_moves_toward_the_ghost_list_asked_for():
    arc = ARC(3)
    arc.offer(1)
    arc.offer(2)
    assert request(arc, (1,)) == 1  # a hit: 1 into T2
    assert [arc.offer(3), arc.offer(4)] == [None, 2]  # full: T1 (2 blocks) is above p = 0
    assert list(arc.recent) == [3, 4] and list(arc.recent_ghosts) == [2] and arc.recent_target == 0.0
    assert request(arc, (2,)) == 0  # a miss on a B1 ghost: a longer T1 would have served it
    assert arc.recent_target == 1.0
    assert arc.offer(2) == 3  # T1 is still above p = 1; 2, asked for as a ghost, enters T2
    assert list(arc.recent) == [4] and list(arc.frequent) == [1, 2] and list(arc.recent_ghosts) == [3]
    assert request(arc, (4,)) == 1 and list(arc.frequent) == [1, 2, 4]
    assert arc.offer(5) == 1  # T1 is empty: T2's LRU block goes, to B2
    assert list(arc.frequent_ghosts) == [1]
    assert request(arc, (1,)) == 0  # a miss on a B2 ghost: p falls by max(1, |B1| / |B2|)
    assert arc.recent_target == 0.0
    assert arc.offer(1) == 5 and list(arc.frequent) == [2, 4, 1] and list(arc.recent_ghosts) == [3, 5]


def test_arc_touches_hits_tail_first_so_a_chains_tail_is_evicted_first():
    arc = ARC(3)
    for h in (1, 2, 3):
        arc.offer(h)
    assert request(arc, (1, 2, 3, 9)) == 3
    assert list(arc.frequent) == [3, 2, 1]
    assert [arc.offer(h) for h in (4, 5)] == [3, 4]  # T2's tail first; then T1 (above p = 0)


def test_arc_keeps_its_ghost_lists_within_twice_the_capacity():
    arc = ARC(4)
    for h in range(100):
        arc.offer(h)
        request(arc, (h,))
    lists = (arc.recent, arc.frequent, arc.recent_ghosts, arc.frequent_ghosts)
    assert len(arc.recent) + len(arc.frequent) == 4
    assert len(arc.recent) + len(arc.recent_ghosts) <= 4 and sum(map(len, lists)) <= 8


def test_arc_with_no_capacity_turns_every_block_away():
    arc = ARC(0)
    assert arc.offer(7) == 7 and 7 not in arc


def test_wtinylfu_window_admits_what_the_filter_then_keeps_out_of_main():
    tier = WTinyLFU(10, window_share=0.2)  # a window of 2 blocks, main 8 (protected up to 6)
    assert [tier.offer(h) for h in range(1, 11)] == [None] * 10  # not full: all kept
    assert list(tier.window) == [9, 10] and list(tier.probation) == list(range(1, 9))
    # 11 was never asked for, and gets in through the window; the window's LRU block 9 ties
    # main's victim 1 (no requests either) and is turned away
    assert tier.offer(11) == 9 and 11 in tier and 9 not in tier
    tier.record((1,))  # main's victim now asked for once
    assert tier.offer(12) == 10  # 10 (never asked for) does not beat 1
    tier.record((11, 11))
    assert tier.offer(13) == 1  # 11 (asked for twice) beats 1 (once): it takes 1's place
    assert list(tier.window) == [12, 13] and list(tier.probation) == [2, 3, 4, 5, 6, 7, 8, 11]


def test_wtinylfu_probation_hit_is_protected_from_the_next_eviction():
    tier = WTinyLFU(4, window_share=0.25)  # a window of 1 block, main 3 (protected up to 2)
    for h in (1, 2, 3, 4):
        tier.offer(h)
    assert list(tier.probation) == [1, 2, 3]
    assert request(tier, (1,)) == 1  # 1 moves to protected: main's victim is now 2
    assert list(tier.protected) == [1]
    tier.record((4, 4))
    assert tier.offer(5) == 2 and list(tier.probation) == [3, 4]


def test_wtinylfu_window_share_climbs_while_the_hit_rate_rises_and_turns_when_it_falls():
    tier = WTinyLFU(10, window_share=0.5)
    period = SAMPLE_PER_BLOCK * 10
    tier.offer(1)

    def sample(hits: int) -> None:
        tier.record(tuple(range(1000, 1000 + period)))
        for _ in range(hits):
            tier.touch(1)

    sample(hits=10)
    sample(hits=20)  # the first sample steps the window up (no rate to compare with yet)
    assert tier.window_share == pytest.approx(0.5 + WINDOW_STEP)
    sample(hits=5)  # the hit rate rose: the same way again, a decayed step
    assert tier.window_share == pytest.approx(0.5 + WINDOW_STEP + WINDOW_STEP * STEP_DECAY)
    tier.record((2,))  # the hit rate fell: back the other way
    assert tier.window_share == pytest.approx(0.5 + WINDOW_STEP + WINDOW_STEP * STEP_DECAY * (1 - STEP_DECAY))


def test_wtinylfu_a_shrinking_window_hands_its_lru_blocks_to_probation():
    tier = WTinyLFU(10, window_share=1.0)  # all window: LRU
    for h in range(12):
        tier.offer(h)
    assert list(tier.window) == list(range(2, 12))
    tier.window_share = 0.3
    tier._rebalance()
    assert list(tier.window) == [9, 10, 11] and list(tier.probation) == list(range(2, 9))


def test_make_replacement_names_the_choices():
    assert isinstance(make_replacement("arc", 4), ARC) and isinstance(make_replacement("wtinylfu", 4), WTinyLFU)
    with pytest.raises(ValueError, match="expected one of arc, wtinylfu"):
        make_replacement("lfu", 4)  # type: ignore[arg-type]


def test_replay_of_the_new_policies_counts_leading_hits():
    trace = BlockTrace()
    for h in (1, 2, 3, 4):
        trace.offer(h)
    trace.request((1, 2, 9, 3))  # 1, 2 lead; 3 is resident past a miss
    for policy in ("arc", "wtinylfu"):
        result = replay(trace, 8, policy)
        assert (result.requested_blocks, result.hit_blocks, result.resident_blocks) == (4, 2, 3)
