"""Fork and copy-on-write in the scheduler and the KV cache manager, with no model
(tests/kv_factory.py): exact block ids and copies, siblings through swap and recompute, held
beams, and a property test over random fork / append / free with preemption.

Forked sequences sample tokens of their own (`by_seq`), so siblings diverge and a block written
by one branch that another still reads shows up as wrong KV."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kv_factory import BLOCK_BYTES, BS, check_kv, make_kv, make_scheduler, make_seq, run_step
from tieredkv.sequence import Sequence, SequenceStatus


def by_seq(seq: Sequence) -> int:
    """The token a scripted step samples: differs between siblings."""
    return (seq.num_tokens * 7 + int(seq.seq_id[1:])) % 97


def step(sched, sim):
    return run_step(sched, sim, by_seq)


def prefill_and_fork(sched, sim, seq: Sequence, tokens: list[int]) -> list[Sequence]:
    """Run `seq`'s prompt, then fork it as the decoder does for `n` samples: the sequence and
    its copies get one first token each."""
    sim.kv.retire()
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [seq] and out.scheduled[0].samples
    table = sim.kv.block_table(seq)
    for pos in range(seq.num_tokens):
        sim.gpu[:, :, table[pos // BS], pos % BS] = float(seq.token_ids[pos])
    sched.advance(out)
    family = [seq, *sched.fork(seq, len(tokens) - 1)]
    sched.append(family, tokens)
    return family


def test_a_fork_shares_every_block_and_a_write_copies_the_shared_partial_block_once():
    sim = make_kv(8)
    sched = make_scheduler(sim)
    a = make_seq("a", range(1, 7), max_tokens=6)  # 6 tokens: block 0 full, block 1 half
    sched.add(a)
    a, b, c = prefill_and_fork(sched, sim, a, [50, 51, 52])
    assert sched.running == [a, b, c]
    assert [sim.kv.block_table(s) for s in (a, b, c)] == [[0, 1]] * 3
    assert [blk.ref_count for blk in sim.kv.pool.blocks[:2]] == [3, 3]
    out = step(sched, sim)  # each writes its first token into block 1, slot 2
    # the first two writers get copies, the last writes in place; block 0 (full) is never copied
    assert [sim.kv.block_table(s) for s in (a, b, c)] == [[0, 2], [0, 3], [0, 1]]
    assert sim.kv.stats()["cow_block_copies"] == 2
    assert [blk.ref_count for blk in sim.kv.pool.blocks[:4]] == [3, 1, 1, 1]
    assert len(out.scheduled) == 3
    while sched.has_unfinished():
        for seq in sched.running:
            check_kv(sim, seq)
        step(sched, sim)
    assert sim.kv.stats()["cow_block_copies"] == 2  # later blocks were never shared
    assert len({tuple(s.output_token_ids) for s in (a, b, c)}) == 3
    assert sim.kv.stats()["gpu_blocks_used"] == 0


def test_siblings_swapped_out_move_a_shared_block_once_and_share_it_again_on_the_way_back():
    sim = make_kv(12, num_cpu_blocks=12)
    sched = make_scheduler(sim, "swap")
    a = make_seq("a", range(1, 10), max_tokens=6)  # 9 tokens: blocks 0, 1 full, block 2 one token
    sched.add(a)
    a, b = prefill_and_fork(sched, sim, a, [50, 51])
    step(sched, sim)  # a copies block 2 (copy-on-write), b writes it in place
    assert [sim.kv.block_table(s) for s in (a, b)] == [[0, 1, 3], [0, 1, 2]]
    sched.running.clear()  # preempt both by hand, b first
    assert sim.kv.swap_out(b) and sim.kv.swap_out(a)
    # b moved its three blocks; a found the two full ones in the CPU tier and moved its own third
    assert sim.kv.stats()["bytes_d2h"] == 4 * BLOCK_BYTES
    cpu_a, cpu_b = sim.kv.swap._blocks[a.seq_id], sim.kv.swap._blocks[b.seq_id]
    assert cpu_a[:2] == cpu_b[:2] and cpu_a[2] is not cpu_b[2]
    sim.kv.pool.drop_unowned()  # the GPU forgets its cached copies: everything comes back by copy
    sim.kv.retire()  # the copies out are done: only the swapped sequences hold their blocks
    assert [blk.ref_count for blk in cpu_a] == [2, 2, 1]
    assert sim.kv.swap_in(a, 1) is not None and sim.kv.swap_in(b, 1) is not None
    # a brought back three blocks, b only its third: the full ones are shared again
    assert sim.kv.stats()["bytes_h2d"] == 4 * BLOCK_BYTES
    table_a, table_b = sim.kv.block_table(a), sim.kv.block_table(b)
    assert len(table_a) == len(table_b) == 3 and table_a[:2] == table_b[:2] and table_a[2] != table_b[2]
    assert [sim.kv.pool.blocks[i].ref_count for i in table_a] == [2, 2, 1]
    for seq in (a, b):
        check_kv(sim, seq)


def swapped_siblings():
    """a and b forked from one 9-token prompt, both swapped out, the GPU's cached copies forgotten."""
    sim = make_kv(12, num_cpu_blocks=12)
    sched = make_scheduler(sim, "swap")
    a = make_seq("a", range(1, 10), max_tokens=6)
    sched.add(a)
    a, b = prefill_and_fork(sched, sim, a, [50, 51])
    step(sched, sim)
    sched.running.clear()
    assert sim.kv.swap_out(b) and sim.kv.swap_out(a)
    sim.kv.pool.drop_unowned()
    sim.kv.retire()
    return sim, a, b


def test_a_swap_in_that_fits_only_by_sharing_a_siblings_blocks_goes_ahead():
    sim, a, b = swapped_siblings()
    assert sim.kv.swap_in(a, 1) is not None  # three blocks; b shares the two full ones
    others = sim.kv.pool.allocate(sim.kv.pool.num_free - 1)  # one free block left: b's third
    assert sim.kv.swap_in(b, 1) is not None
    assert sim.kv.block_table(b)[:2] == sim.kv.block_table(a)[:2] and sim.kv.pool.num_free == 0
    check_kv(sim, b)
    sim.kv.pool.release(others)


def test_a_swapped_sequence_short_of_blocks_builds_no_block_keys(monkeypatch):
    sim, a, b = swapped_siblings()
    others = sim.kv.pool.allocate(sim.kv.pool.num_free - 2)  # a needs three
    built = []
    refs = sim.kv.keys.refs
    monkeypatch.setattr(sim.kv.keys, "refs", lambda *args: built.append(args) or refs(*args))
    for _ in range(3):  # asked again every step while it waits
        assert sim.kv.swap_in(a, 1) is None
    assert built == [] and sim.kv.pool.num_free == 2
    sim.kv.pool.release(others)
    assert sim.kv.swap_in(a, 1) is not None and len(built) == 1
    check_kv(sim, a)


def test_a_recomputed_child_finds_the_blocks_it_shares_with_its_siblings():
    sim = make_kv(20)
    sched = make_scheduler(sim)
    a = make_seq("a", range(1, 10), max_tokens=6)
    sched.add(a)
    a, b = prefill_and_fork(sched, sim, a, [50, 51])
    step(sched, sim)
    sched.running.remove(b)
    sched._preempt(b)  # recompute: b loses its blocks and goes back to waiting
    assert sched.waiting[0] is b and b.num_computed_tokens == 0
    out = step(sched, sim)
    # of its 11 tokens, the first 8 (two full blocks) are found in a's blocks: it computes 3
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 3)]
    assert sim.kv.block_table(b)[:2] == sim.kv.block_table(a)[:2]


@pytest.mark.parametrize("policy", ["fcfs", "ttft"])
def test_held_sequences_wait_and_the_newest_held_one_makes_room(policy):
    sim = make_kv(12)
    sched = make_scheduler(sim, max_num_seqs=2, scheduling_policy=policy)
    a, b, c = (make_seq(r, range(10 * i + 1, 10 * i + 5), max_tokens=4) for i, r in enumerate("abc"))
    for seq in (a, b, c):
        sched.add(seq)
    step(sched, sim)
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    a.token_ids.pop()  # as a beam's step leaves them: all computed, next token not chosen yet
    b.token_ids.pop()
    sched.hold(a)
    sched.hold(b)
    out = sched.schedule()  # nothing runs, c has no slot: the newest held sequence leaves
    assert out.scheduled == [] and out.preempted == [b]
    assert sched.running == [a] and list(sched.waiting) == [b, c] and b.held
    out = step(sched, sim)  # held b waits; c is admitted
    assert [s.seq for s in out.scheduled] == [c]
    sched.append([a, b], [60, 61])  # their tokens are chosen: both run again (b recomputes)
    while c in sched.running:
        step(sched, sim)
    out = step(sched, sim)
    assert b in [s.seq for s in out.scheduled]


# ---------------------------------------------------------------- property test

adds = st.tuples(st.just("add"), st.tuples(st.integers(1, 11), st.integers(1, 9)))  # prompt length, max tokens
queues = st.sampled_from(["running", "swapped", "waiting"])
forks = st.tuples(st.just("fork"), st.tuples(queues, st.integers(0, 99), st.integers(1, 3)))  # which, copies
steps = st.tuples(st.just("step"), st.integers(1, 3))
ops = st.tuples(
    st.lists(adds, min_size=2, max_size=4),  # a few requests running first, then anything
    st.lists(st.one_of(adds, steps, steps, forks, forks, st.tuples(st.just("free"), st.integers(0, 99))),
             min_size=6, max_size=36),
).map(lambda parts: [*parts[0], ("step", 2), *parts[1]])


def live(sched) -> list[Sequence]:
    return [*sched.running, *sched.swapped, *sched.waiting]


def check_accounting(sched, sim) -> None:
    """Ref counts equal owners in both tiers; a block is free exactly when nobody owns it; every
    sequence reads back its own tokens' KV, on the GPU and in its swapped-out CPU blocks."""
    kv = sim.kv
    gpu_owners = Counter(id(blk) for table in kv.tables._blocks.values() for blk in table)
    for blk in kv.pool.blocks:
        assert blk.ref_count == gpu_owners[id(blk)], f"GPU block {blk.block_id}"
        assert kv.pool.is_free(blk) == (blk.ref_count == 0), f"GPU block {blk.block_id}"
    held = [*kv.swap._blocks.values(), *kv.offload._held.values()]  # swapped sequences, copies in flight
    cpu_owners = Counter(id(blk) for blocks in held for blk in blocks)
    for blk in kv.offload.pool.blocks:
        assert blk.ref_count == cpu_owners[id(blk)], f"CPU block {blk.block_id}"
        assert kv.offload.pool.is_free(blk) == (blk.ref_count == 0), f"CPU block {blk.block_id}"
    for seq in sched.running:
        check_kv(sim, seq)
    for seq in sched.swapped:
        cpu = kv.swap._blocks[seq.seq_id]
        for pos in range(seq.num_computed_tokens):
            got = kv.offload.tier.data[cpu[pos // BS].block_id, :, :, pos % BS]
            assert torch.all(got == seq.token_ids[pos]), f"{seq.seq_id}: swapped KV of token {pos}"


@pytest.mark.parametrize("policy", ["fcfs", "ttft"])
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_random_fork_append_free(preemption, policy, ops):
    # 8 GPU blocks of 4 tokens: a few sequences and their forks fill them, so they preempt each other
    sim = make_kv(8, num_cpu_blocks=16)
    sched = make_scheduler(sim, preemption, max_num_seqs=6, max_num_batched_tokens=16, scheduling_policy=policy)
    added = 0
    for kind, arg in ops:
        seqs = [s for s in live(sched) if not s.is_finished]
        if kind == "add":
            length, max_tokens = arg
            sched.add(make_seq(f"r{added}", [added * 13 + j for j in range(length)], max_tokens))
            added += 1
        elif kind == "step":
            for _ in range(arg):
                step(sched, sim)
        elif kind == "fork" and seqs:
            queue, which, copies = arg
            candidates = [s for s in getattr(sched, queue) if not s.is_finished] or seqs
            parent = candidates[which % len(candidates)]
            for child in sched.fork(parent, copies):
                assert child.status is parent.status and child.token_ids == parent.token_ids
        elif kind == "free" and seqs:
            sched.abort(seqs[arg % len(seqs)])
        check_accounting(sched, sim)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        step(sched, sim)
        check_accounting(sched, sim)
    assert not sched.has_unfinished()
    sim.kv.retire()
    assert sim.kv.stats()["gpu_blocks_used"] == 0 and sim.kv.stats()["cpu_blocks_used"] == 0
    assert all(s.status is SequenceStatus.FINISHED for s in live(sched))
