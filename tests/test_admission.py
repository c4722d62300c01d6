"""The CPU tier's admission policies and the offline replay of a block trace (LRU, TinyLFU,
adaptive, Belady): on the access pattern that breaks LRU (conversations returning in turn over
more history than the tier holds), on the one that breaks TinyLFU (blocks asked for once more,
the next turn), and on both in sequence; exact eviction orders; the model-free trace."""

from __future__ import annotations

import pytest

from tieredkv.cache.trace import BlockTrace, replay, simulate
from tieredkv.replacement import AdaptiveAdmission, FrequencyAdmission, GhostTier

POLICIES = ("lru", "tinylfu", "adaptive", "belady")


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
    assert admission.admits_spare(2, 2) and not admission.admits_spare(3, 2)  # a spare place: a tie will do
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
    for policy in POLICIES:
        result = replay(trace, 1000, policy)
        assert result.hit_blocks == result.requested_blocks > 0


def test_replay_with_no_capacity_hits_nothing():
    trace = multi_turn_trace(users=2, turns=3, first_blocks=2, blocks_per_turn=1)
    assert all(replay(trace, 0, p).hit_blocks == 0 for p in POLICIES)


def test_belady_holds_the_most_requested_blocks_block_by_block():
    trace = multi_turn_trace(users=9, turns=6, first_blocks=12, blocks_per_turn=3)
    for capacity in (20, 60, 120):
        rates = {p: replay(trace, capacity, p).resident_rate for p in POLICIES}
        assert rates["belady"] >= max(rates["lru"], rates["tinylfu"], rates["adaptive"])


def once_reused_trace(conversations: int, turns: int, blocks_per_turn: int, first_block: int = 0) -> BlockTrace:
    """Conversations take turns; each turn offers its new blocks (tail first, as the GPU evicts
    them) and asks for the previous turn's blocks, once: real chat traffic, which frequency
    admission turns away (every new block has been asked for less than the tier's residents)."""
    trace, previous, block = BlockTrace(), {}, first_block
    for _ in range(turns):
        for c in range(conversations):
            if c in previous:
                trace.request(previous[c])
            previous[c] = tuple(range(block, block + blocks_per_turn))
            block += blocks_per_turn
            for new in reversed(previous[c]):
                trace.offer(new)
    return trace


def hits(trace: BlockTrace, capacity: int) -> dict[str, int]:
    return {p: replay(trace, capacity, p).hit_blocks for p in POLICIES}


def test_adaptive_serves_the_cyclic_reuse_that_defeats_lru():
    found = hits(multi_turn_trace(users=12, turns=8, first_blocks=20, blocks_per_turn=2), 144)
    assert found["lru"] == 0 and found["tinylfu"] == 952  # of 2,352 requested
    assert found["adaptive"] >= 0.8 * found["tinylfu"]  # 808: it follows TinyLFU once its ghost hits


def test_adaptive_serves_the_once_reused_turns_that_defeat_tinylfu():
    found = hits(once_reused_trace(conversations=6, turns=30, blocks_per_turn=4), 40)
    assert found["tinylfu"] == 40 and found["lru"] == 580  # of 696 requested
    assert found["adaptive"] >= 0.95 * found["lru"]  # 568


def test_adaptive_beats_both_when_the_traffic_changes_from_one_pattern_to_the_other():
    trace = multi_turn_trace(users=12, turns=8, first_blocks=20, blocks_per_turn=2)
    trace.events += once_reused_trace(conversations=6, turns=30, blocks_per_turn=4, first_block=10**6).events
    found = hits(trace, 40)
    assert found["adaptive"] > max(found["lru"], found["tinylfu"])  # 700 against 580 and 280


def test_ghost_tier_evicts_in_lru_order_and_touches_a_chain_tail_first():
    tier = GhostTier(3)
    for block in (3, 2, 1):  # a chain 1 -> 2 -> 3, offered tail first as the GPU evicts it
        tier.offer(block, lambda candidate, victim: True)
    assert list(tier.resident) == [3, 2, 1]
    tier.offer(9, lambda candidate, victim: True)
    assert list(tier.resident) == [2, 1, 9]  # the tail went first
    assert tier.request((1, 2, 3)) == 2  # leading hits 1, 2; 3 is gone
    assert list(tier.resident) == [9, 2, 1]  # touched tail first: the head is evicted last
    tier.offer(3, lambda candidate, victim: False)  # turned down: nothing moves
    tier.offer(2, lambda candidate, victim: False)  # resident: refreshed whatever admission says
    assert list(tier.resident) == [9, 1, 2]
    tier.offer(4, lambda candidate, victim: victim == 9)
    assert list(tier.resident) == [1, 2, 4]


def test_adaptive_admits_all_until_the_frequency_ghost_hits_more_then_by_count():
    policy = AdaptiveAdmission(capacity_blocks=2)
    policy.record([1, 1, 2])  # counts: 1 twice, 2 once
    assert not policy.by_frequency and policy.admits(3, 1) and not policy.selective  # a tie is LRU
    for block in (1, 2):  # both ghosts now hold 1 and 2
        policy.offered(block)
    policy.offered(5)  # the LRU ghost keeps 5 (evicting 1), the TinyLFU ghost turns it down
    policy.record([1])  # a hit in the TinyLFU ghost only
    assert policy.ghost_hits == [0.0, 1.0] and policy.by_frequency and policy.selective
    assert not policy.admits(3, 1) and policy.admits(1, 2) and not policy.admits(2, 1)
    assert policy.admits_spare(1, 1) and not policy.admits_spare(2, 1)
    policy.record([5, 5], num_hits_above=2)  # found on the GPU: nothing asked of the tier, no ghost hit
    assert policy.ghost_hits[0] == 0.0


@pytest.mark.parametrize("gpu_blocks", [2, 3])
def test_simulated_gpu_tier_offers_evicted_tails_first_and_asks_past_its_hits(gpu_blocks):
    requests = [((1, 2), (1, 2, 3)), ((1, 2, 3, 4), (1, 2, 3, 4)), ((7,), (7,))]
    trace = simulate(requests, gpu_blocks)
    if gpu_blocks == 2:  # the chains outgrow the GPU: their tails go first, then older chains
        assert trace.events == [(1, 2), 3, (3, 4), 4, 3, (7,), 2]
    else:  # 1, 2, 3 stay; the second request's tail 4 goes, then the oldest, 3
        assert trace.events == [(1, 2), (4,), 4, (7,), 3]
