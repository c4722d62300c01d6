"""How a step's token budget is shared (`tieredkv.scheduling`): the pure policy on plain
numbers, then scenarios through the real scheduler and KV cache manager with no model
(tests/kv_factory.py), counting steps: short prompts behind a long one, decodes beside long
prefills, a long prompt under a stream of short ones, a prompt whose KV is resident."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.kv_factory import make_kv, make_scheduler, make_seq, run_step
from tieredkv.config import EngineConfig
from tieredkv.policy import CostModel
from tieredkv.scheduler import HELD_BACK
from tieredkv.scheduling import (
    PrefillCandidate,
    chunk_cost,
    chunk_tokens,
    prefill_order,
    response_ratio,
    share_budget,
)

# ------------------------------------------------------------------ the policy, on numbers


@pytest.mark.parametrize(
    "wants, budget, cap, shares",
    [
        ([5000, 300, 4000], 2048, 512, [1236, 300, 512]),  # capped in order, the rest in order
        ([5000, 300, 4000], 2048, None, [2048, 0, 0]),
        ([100, 200], 2048, 512, [100, 200]),  # everyone fits
        ([700, 700, 700, 700], 2300, 512, [700, 576, 512, 512]),
        ([700, 700, 700, 700], 2000, 512, [512, 512, 512, 464]),
        ([5000, 300], 0, 512, [0, 0]),
    ],
)
def test_share_budget(wants, budget, cap, shares):
    assert share_budget(wants, budget, cap) == shares


def test_fewest_tokens_left_go_first_until_a_long_wait_outranks_them():
    long, short, middle = PrefillCandidate(100_000, 0), PrefillCandidate(2_000, 0), PrefillCandidate(50_000, 0)
    assert prefill_order([long, short, middle], aging=0.5) == [1, 2, 0]
    aged = PrefillCandidate(100_000, waited_tokens=196_000)  # 100,000 - 98,000 < 2,000
    assert prefill_order([aged, short, middle], aging=0.5) == [0, 1, 2]
    assert prefill_order([aged, short, middle], aging=0.0) == [1, 2, 0]
    assert prefill_order([short, PrefillCandidate(2_000, 0)], aging=0.5) == [0, 1]  # ties: given order


def test_hrrn_ranks_by_wait_relative_to_size():
    assert response_ratio(1_000, 3_000) == 4.0
    long, short = PrefillCandidate(100_000, waited_tokens=50_000), PrefillCandidate(2_000, 0)
    assert prefill_order([long, short], aging=0.5, policy="hrrn") == [0, 1]  # 1.5 against a fresh 1.0
    assert prefill_order([long, PrefillCandidate(2_000, 2_000)], aging=0.5, policy="hrrn") == [1, 0]  # 2.0
    assert prefill_order([long, short], aging=0.5, policy="ttft") == [1, 0]


def test_a_chunk_deep_in_a_prompt_is_charged_for_its_attention():
    assert chunk_cost(0, 2048, 0.0) == 2048 and chunk_tokens(100_000, 2048, 0.0) == 2048
    weight = 6.78e-10 / 2.94e-5  # llama-3-8b on an H200: b / a
    assert chunk_tokens(0, 2048, weight) == 1959  # its own pairs: 2048 tokens would cost 2145
    assert chunk_tokens(100_000, 2048, weight) == 364  # 100k deep: each token attends to 100k more


@given(st.integers(0, 200_000), st.floats(0, 10_000), st.floats(0, 1e-3))
def test_chunk_tokens_is_the_most_that_fits(done, budget, weight):
    n = chunk_tokens(done, budget, weight)
    assert chunk_cost(done, n, weight) <= budget + 1e-6 and chunk_cost(done, n + 1, weight) > budget - 1e-6


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "scheduler, message",
    [
        ({"scheduling_policy": "sjf"}, "scheduling_policy: 'sjf' is not allowed; choose one of 'fcfs', 'ttft', 'hrrn'"),
        ({"scheduling_policy": "ttft", "max_prefill_chunk_tokens": 0}, "max_prefill_chunk_tokens: expected an integer"),
        ({"scheduling_policy": "fcfs", "max_prefill_chunk_tokens": 512}, "set scheduling_policy: ttft or drop the cap"),
        ({"scheduling_policy": "ttft", "prefill_aging": -1}, "prefill_aging: expected a number >= 0"),
        ({"prefill_agin": 1}, "did you mean 'scheduler.prefill_aging'"),
    ],
)
def test_bad_scheduling_keys_name_the_key(scheduler, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict({"scheduler": scheduler})


def test_scheduling_keys_as_yaml_writes_them():
    config = EngineConfig.from_dict({"scheduler": {"scheduling_policy": "ttft", "max_prefill_chunk_tokens": "512",
                                                   "prefill_aging": "2.5e-1"}}).scheduler
    assert (config.scheduling_policy, config.max_prefill_chunk_tokens, config.prefill_aging) == ("ttft", 512, 0.25)


# ------------------------------------------------------------------ scenarios


def first_token_steps(sched, sim, seqs, steps: int) -> dict[str, int]:
    """Run `steps` steps; the step (counted from 1) at which each of `seqs` got its first token."""
    got = {}
    for step in range(1, steps + 1):
        run_step(sched, sim)
        got.update({s.request_id: step for s in seqs if s.num_output_tokens and s.request_id not in got})
    return got


@pytest.mark.parametrize("policy, first_tokens", [("ttft", [3, 3, 3]), ("fcfs", [7, 7, 7])])
def test_short_prompts_behind_a_long_one_get_their_first_token_at_once(policy, first_tokens):
    """A 400-token prompt, then three 8-token ones two steps later, 64 tokens a step: fcfs holds
    them until the long prefill is done (step 7); ttft serves them the step they arrive."""
    sim = make_kv(128)
    sched = make_scheduler(sim, max_num_batched_tokens=64, scheduling_policy=policy)
    long = make_seq("long", range(1000, 1400), max_tokens=2)
    sched.add(long)
    run_step(sched, sim)
    run_step(sched, sim)
    shorts = [make_seq(f"s{i}", range(10 * i, 10 * i + 8), max_tokens=2) for i in range(3)]
    for seq in shorts:
        sched.add(seq)
    got = first_token_steps(sched, sim, [*shorts, long], 8)
    assert [got[s.request_id] + 2 for s in shorts] == first_tokens
    assert got["long"] + 2 == 7  # the long prompt loses no step for them: 400 tokens need 7 anyway


@pytest.mark.parametrize("policy", ["ttft", "fcfs"])
def test_decodes_get_a_token_every_step_beside_long_prefills(policy):
    """Decoding sequences beside a stream of long and short prompts (more than the budget):
    every sequence gets a token every step from its first token to its last."""
    sim = make_kv(512)
    sched = make_scheduler(sim, max_num_seqs=16, max_num_batched_tokens=64, scheduling_policy=policy)
    seqs = []
    for step in range(30):
        arriving = [make_seq(f"short{step}", range(step * 20, step * 20 + 12), max_tokens=10)]
        if step % 4 == 0:
            arriving.insert(0, make_seq(f"long{step}", range(2000 + step * 300, 2200 + step * 300), max_tokens=10))
        for seq in arriving:
            sched.add(seq)
        seqs += arriving
        before = {s.request_id: s.num_output_tokens for s in seqs}
        out = run_step(sched, sim)
        assert not out.preempted
        for s in seqs:
            if 0 < before[s.request_id] < s.params.max_tokens:
                assert s.num_output_tokens == before[s.request_id] + 1, f"{s.request_id} missed step {step}"


def aging_scenario(aging: float, steps: int) -> int | None:
    """A 256-token prompt, then two 40-token prompts every step (80 tokens wanted a step, 64
    given): the step at which the long prompt got its first token (None: not within `steps`)."""
    sim = make_kv(1024)
    sched = make_scheduler(sim, max_num_seqs=64, max_num_batched_tokens=64, scheduling_policy="ttft",
                           prefill_aging=aging)
    long = make_seq("long", range(5000, 5256), max_tokens=1)
    sched.add(long)
    for step in range(1, steps + 1):
        for i in range(2):
            sched.add(make_seq(f"s{step}.{i}", range(step * 100 + i * 50, step * 100 + i * 50 + 40), max_tokens=1))
        run_step(sched, sim)
        if long.num_output_tokens:
            return step
    assert long.num_computed_tokens == 0
    return None


def test_aging_keeps_a_long_prompt_from_starving():
    assert aging_scenario(0.0, steps=60) is None  # short prompts forever ahead of it
    # it outranks new arrivals after (256 - 40) / 0.5 = 432 tokens of work (7 steps), starts in
    # step 9 and takes 4 more; with aging 2, after 108 tokens (step 3)
    assert aging_scenario(0.5, steps=60) == 13
    assert aging_scenario(2.0, steps=60) == 7


def long_under_stream(policy: str, shorts_per_step: int, steps: int = 80) -> int | None:
    """A 256-token prompt, then `shorts_per_step` 40-token prompts every step, 64 tokens a step:
    the step at which the long prompt got its first token (None: not within `steps`)."""
    sim = make_kv(1024)
    sched = make_scheduler(sim, max_num_seqs=64, max_num_batched_tokens=64, scheduling_policy=policy)
    long = make_seq("long", range(5000, 5256), max_tokens=1)
    sched.add(long)
    for step in range(1, steps + 1):
        for i in range(shorts_per_step):
            sched.add(make_seq(f"s{step}.{i}", range(step * 100 + i * 50, step * 100 + i * 50 + 40), max_tokens=1))
        run_step(sched, sim)
        if long.num_output_tokens:
            return step
    return None


@pytest.mark.parametrize("policy, within_load, overloaded", [("hrrn", 6, 31), ("ttft", 9, 47), ("fcfs", 4, 4)])
def test_a_long_prompt_is_served_within_a_bound_under_a_stream_of_short_ones(policy, within_load, overloaded):
    """Alone the long prompt needs 4 steps. Beside one short prompt a step (40 of the 64 tokens)
    hrrn serves it in 6 steps; beside two (80 tokens wanted a step: the queue grows without
    end) in 31, while ttft at its default aging takes 9 and 47 (fcfs serves it first, and
    holds the short ones behind it)."""
    assert long_under_stream(policy, 1) == within_load
    assert long_under_stream(policy, 2) == overloaded


def test_a_prompt_whose_kv_is_resident_goes_before_a_shorter_one_that_must_compute():
    """A 400-token document was served; a fresh 100-token prompt arrives, then a question on the
    document (408 tokens, 400 of them cached on the GPU): ttft computes the question's 8 tokens
    first; fcfs gives the whole step to the fresh prompt."""
    order = {}
    for policy in ("ttft", "fcfs"):
        sim = make_kv(256)
        sched = make_scheduler(sim, max_num_batched_tokens=64, scheduling_policy=policy)
        sched.add(make_seq("doc", range(1000, 1400), max_tokens=1))
        while sched.has_unfinished():
            run_step(sched, sim)
        fresh, question = make_seq("fresh", range(100), max_tokens=1), make_seq("q", [*range(1000, 1400), *range(8)])
        sched.add(fresh)
        sched.add(question)
        order[policy] = [(s.seq.request_id, s.num_new_tokens) for s in run_step(sched, sim).scheduled]
    assert order == {"ttft": [("q", 8), ("fresh", 56)], "fcfs": [("fresh", 64)]}


def test_with_a_cost_model_a_step_beside_decodes_costs_what_its_budget_says():
    """b/a = 1/256: a chunk after c tokens is charged n + (2cn + n^2)/256; beside a decode a
    long prefill's chunks shrink as it goes deeper, alone it takes the whole budget."""
    cost = CostModel(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, prefill_s_per_token=1e-3,
                     prefill_s_per_token_sq=1e-3 / 256)
    sim = make_kv(300)
    sched = make_scheduler(sim, cost=cost, max_num_batched_tokens=64, scheduling_policy="ttft")
    decoder = make_seq("decoder", range(8), max_tokens=8)
    sched.add(decoder)
    run_step(sched, sim)  # its prefill
    long = make_seq("long", range(1000, 2000), max_tokens=1)
    sched.add(long)
    chunks = [[(s.seq.request_id, s.num_new_tokens) for s in run_step(sched, sim).scheduled] for _ in range(5)]
    assert chunks == [[("decoder", 1), ("long", n)] for n in (52, 40, 34, 29, 27)]
    done = 0
    for (_, _), (_, n) in chunks:  # the most that fits beside the decode
        assert 1 + chunk_cost(done, n, 1 / 256) <= 64 < 1 + chunk_cost(done, n + 1, 1 / 256)
        done += n
    while not decoder.is_finished:
        run_step(sched, sim)
    assert long.num_computed_tokens == 230  # deep, with no decode beside it: a token is a token
    assert [(s.seq.request_id, s.num_new_tokens) for s in run_step(sched, sim).scheduled] == [("long", 64)]


def test_a_fork_of_a_waiting_request_keeps_its_arrival():
    # one sequence slot: p (40 tokens) waits while r decodes; p forks (as a preempted sample may),
    # p is aborted and q (4 tokens) arrives. The fork waited as long as p, 120 tokens of work at
    # aging 1: it ranks ahead of q, which has fewer tokens left but waited half as long
    sim = make_kv(64)
    sched = make_scheduler(sim, max_num_seqs=1, scheduling_policy="ttft", prefill_aging=1.0)
    r = make_seq("r", range(1, 9), max_tokens=120)
    sched.add(r)
    run_step(sched, sim)
    p = make_seq("p", range(100, 140), max_tokens=2)
    sched.add(p)
    for _ in range(60):
        run_step(sched, sim)
    (child,) = sched.fork(p, 1)
    sched.abort(p)
    q = make_seq("q", range(200, 204), max_tokens=2)
    sched.add(q)
    started = []
    while sched.has_unfinished():
        started += [s.seq for s in run_step(sched, sim).scheduled if s.seq not in started]
    assert started == [r, child, q]


def test_each_step_counts_what_held_a_waiting_prompt_back():
    """`held_back`: a prompt waiting for a sequence slot counts a `slots` step; one waiting for GPU
    blocks held by a long decode counts a `blocks` step each step until the decode ends; a
    sequence preempted back to the queue counts a `preempted` step for the step that did it."""
    sim = make_kv(64)
    sched = make_scheduler(sim, max_num_seqs=1, scheduling_policy="ttft")
    for seq in (make_seq("long", range(40), max_tokens=3), make_seq("short", range(100, 120), max_tokens=1)):
        sched.add(seq)
    for _ in range(6):
        run_step(sched, sim)
    assert sched.held_back == {"slots": 1}  # the short one ranks first; the long one waited a step

    sim = make_kv(32)  # 128 tokens: the decode (100 + 20 tokens) leaves no room for 60 more
    sched = make_scheduler(sim, scheduling_policy="ttft")
    decoding, waiting = make_seq("decoding", range(100), max_tokens=20), make_seq("waiting", range(1000, 1060), 1)
    sched.add(decoding)
    run_step(sched, sim)
    run_step(sched, sim)
    sched.add(waiting)
    for _ in range(24):
        run_step(sched, sim)
    assert decoding.num_output_tokens == 20 and waiting.num_output_tokens == 1
    assert sched.held_back == {"blocks": 19}  # each of the decode's 19 steps left
    assert set(sched.held_back) <= set(HELD_BACK)

    sim = make_kv(32)  # two decodes outgrow it: the newer is preempted (recomputed) in step 16
    sched = make_scheduler(sim, max_num_batched_tokens=128, scheduling_policy="ttft")
    for rid, first in (("a", 0), ("b", 1000)):
        sched.add(make_seq(rid, range(first, first + 50), max_tokens=40))
    for _ in range(60):
        run_step(sched, sim)
    # the step that preempted it admits nothing; then it waits for the blocks the other decode holds
    assert sched.held_back == {"preempted": 1, "blocks": 24}


@pytest.mark.parametrize("cpu_blocks, kinds, for_room", [(0, ("recompute", 64), 0), (4, ("recompute", 64), 1),
                                                          (64, ("swap", 64), 0)])
def test_preemptions_count_the_tokens_they_held_and_the_swaps_the_cpu_tier_had_no_room_for(cpu_blocks, kinds,
                                                                                           for_room):
    """Two decodes outgrow 32 GPU blocks: the newer is preempted with 64 computed tokens (16
    blocks), swapped out where the CPU tier has room for them, recomputed where it has none
    (counted as a swap the tier had no room for) or where there is no CPU tier."""
    sim = make_kv(32, num_cpu_blocks=cpu_blocks)
    sched = make_scheduler(sim, preemption="swap" if cpu_blocks else "recompute", max_num_batched_tokens=128)
    for rid, first in (("a", 0), ("b", 1000)):
        sched.add(make_seq(rid, range(first, first + 50), max_tokens=40))
    for _ in range(60):
        run_step(sched, sim)
    kind, tokens = kinds
    assert sched.num_preemptions[kind] == 1 and sched.preempted_tokens == {"recompute": 0, "swap": 0} | {kind: tokens}
    assert sched.recomputed_for_cpu_room == for_room
