"""The NVMe tier inside the engine: exact tokens when prefixes come back from disk, after a
restart, with every I/O backend, and when the disk misbehaves."""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import time

import pytest

from tests.reference import make_prompts, settle_writes
from tieredkv import LLM, SamplingParams
from tieredkv.policy import CostModel
from tieredkv.tiers.nvme import STORE_FILE_NAME

NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
BLOCK_BYTES = 2048  # tiny-llama, block size 4, float32: 2 layers x K/V x 4 tokens x 2 heads x 16 dims x 4 B


# a disk so fast that loading always beats recomputing (the calibrated tiny model on a CPU
# would recompute everything)
LOAD_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1e-3,
             "disk_read_bytes_per_s": 1e15}


def tiered_llm(path, backend: str = "sync", cost_model: dict = LOAD_WINS, cpu_policy: str = "lru", **kw) -> LLM:
    """GPU and CPU tiers so small that most prefixes end up on NVMe. The LRU CPU tier writes
    every block it demotes; the default frequency policy only those asked for again."""
    return LLM(**{"model": "tiny-llama", "block_size": 4, "num_gpu_blocks": 30, "cpu_cache_bytes": 24 * BLOCK_BYTES,
                  "cpu_policy": cpu_policy, "nvme_path": str(path), "nvme_bytes": "4MiB", "io_backend": backend,
                  "preemption": "recompute", "scheduler": {"cost_model": cost_model}, **kw})


def test_blocks_asked_for_again_are_written_and_served_after_restart(tmp_path, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path, cpu_policy="tinylfu") as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        first = settle_writes(llm)["nvme_spilled_blocks"]
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert settle_writes(llm)["nvme_spilled_blocks"] > first  # asked for again: now worth a write
    with tiered_llm(tmp_path, cpu_policy="tinylfu") as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert llm.stats()["nvme_loaded_blocks"] > 0


@pytest.mark.parametrize("backend", ["sync", "aiofiles", "uring"])
def test_prefixes_come_back_from_nvme_after_restart(tmp_path, backend, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path, backend) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
    # a new engine on the same path finds what the first one spilled
    with tiered_llm(tmp_path, backend) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["nvme_loaded_blocks"] > 0 and stats["nvme_failed_loads"] == 0
    # every block loaded was planned: by a request's plan, or read ahead of it (planned to be
    # computed, read instead while the disk was idle)
    planned = stats["nvme_prefix_blocks"]["load"] + stats["nvme_read_ahead_blocks"]
    assert stats["nvme_loaded_blocks"] <= planned, stats


def test_a_disk_slower_than_recompute_is_counted_and_not_read(tmp_path, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with tiered_llm(tmp_path, cost_model={**LOAD_WINS, "disk_read_bytes_per_s": 1.0}) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["nvme_prefix_blocks"]["compute"] > 0 and stats["nvme_prefix_blocks"]["load"] == 0
    assert stats["nvme_loaded_blocks"] == 0


def test_another_model_never_reuses_the_store(tmp_path, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    with tiered_llm(tmp_path) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path, seed=1) as llm:  # other weights: another fingerprint
        assert llm.stats()["nvme_restored"] == 0  # none of the first model's blocks is findable
        llm.generate(prompts, GREEDY, use_tqdm=False)  # (it may read back blocks it wrote itself)
    with tiered_llm(tmp_path) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def damage_payloads(path, geometry) -> int:
    """Flip one byte in the middle of every slot's payload; returns how many."""
    count = 0
    with open(os.path.join(path, STORE_FILE_NAME), "r+b") as f:
        for slot in range(geometry.num_slots):
            offset = geometry.slot_offset(slot) + geometry.header_bytes + BLOCK_BYTES // 2
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
            count += 1
    return count


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_store_costs_recompute_not_wrong_tokens(tmp_path, damage, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        geometry = llm.kv.offload.lower.store.geometry
    file = os.path.join(tmp_path, STORE_FILE_NAME)
    if damage == "flip":
        assert damage_payloads(tmp_path, geometry) > 0
    elif damage == "truncate":
        os.truncate(file, os.path.getsize(file) // 3)
    with tiered_llm(tmp_path) as llm:
        if damage == "delete":
            os.remove(file)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    if damage == "flip":
        assert stats["nvme_failed_loads"] > 0 and stats["nvme_corrupt"] > 0


# per token: 1 ms of prefill; per block of 4 tokens: 4 ms to load from disk, ~0 over PCIe
BALANCED = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1e-3,
            "disk_read_bytes_per_s": BLOCK_BYTES / 3e-3}


def test_split_puts_compute_first_and_loads_last():
    from tieredkv.policy import CostModel, split_lower_prefix

    cost = CostModel(**BALANCED)
    # a block read in 3 ms, computed in 4: compute 4 while 6 load
    assert split_lower_prefix(10, BLOCK_BYTES, 0, 4, cost) == 4
    # a disk 4x slower than compute: alone, the last 2 blocks load while 8 compute (32 ms
    # against 40); behind a queue, compute all 10 (the overlap saves 20%, no block's load anything)
    slow = CostModel(**{**BALANCED, "disk_read_bytes_per_s": BLOCK_BYTES / 16e-3})
    assert split_lower_prefix(10, BLOCK_BYTES, 0, 4, slow) == 8
    assert split_lower_prefix(10, BLOCK_BYTES, 0, 4, slow, gpu_queue_tokens=4) == 10
    assert split_lower_prefix(10, BLOCK_BYTES, 0, 4, slow, lower_queue_bytes=BLOCK_BYTES) == 10
    # a disk far faster than compute: load everything
    fast = CostModel(**{**BALANCED, "disk_read_bytes_per_s": 1e15})
    assert split_lower_prefix(10, BLOCK_BYTES, 0, 4, fast) == 0
    # no disk bandwidth known: load everything
    assert split_lower_prefix(10, BLOCK_BYTES, 0, 4, None) == 0


def test_load_and_recompute_at_once_is_exact(tmp_path, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    # small steps: computing the blocks before the loaded ones takes several steps, time for
    # the reads to land (a load that has not landed when compute reaches it is computed instead)
    with tiered_llm(tmp_path, cost_model=BALANCED, max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    # prefills jumped over blocks loaded from disk while computing the ones before them
    assert stats["nvme_skipped_tokens"] > 0
    assert stats["nvme_loaded_blocks"] > 0 and stats["nvme_failed_loads"] == 0


@pytest.mark.parametrize(
    "op, fault, err",
    [("read", "error", errno.EIO), ("read", "short", 0), ("read", "raise", errno.EIO),
     ("write", "error", errno.ENOSPC), ("write", "short", 0)],
)
def test_io_faults_cost_recompute_not_wrong_tokens(tmp_path, op, fault, err, reference_outputs, monkeypatch):
    from tieredkv.tiers.nvme import store as nvme
    from tieredkv.tiers.nvme.io_backends import FaultyBackend

    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    if op == "read":  # a first engine fills the store
        with tiered_llm(tmp_path) as llm:
            llm.generate(prompts, GREEDY, use_tqdm=False)
    real_make_backend = nvme.make_backend
    faulty: list[FaultyBackend] = []

    def make_faulty(*args, **kwargs):  # the store's I/O seam
        faulty.append(FaultyBackend(real_make_backend(*args, **kwargs)))
        return faulty[-1]

    monkeypatch.setattr(nvme, "make_backend", make_faulty)
    with tiered_llm(tmp_path) as llm:
        faulty[-1].inject(op, fault, err, count=10)  # the next ten `op`s after the store opened
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
        again = llm.generate(prompts, GREEDY, use_tqdm=False)  # and it keeps serving
    assert [o.token_ids for o in outs] == [o.token_ids for o in again] == expected
    assert stats["nvme_io_errors"] > 0
    if op == "read":
        assert stats["nvme_failed_loads"] > 0


def test_queued_requests_load_prefixes_spilled_while_they_waited(tmp_path, reference_outputs):
    # every question arrives at once, asked round-robin over documents that do not fit in GPU +
    # CPU: a document's later questions wait in the queue while its blocks move on to NVMe (in
    # arrival order: `ttft` serves them first while their document is resident)
    rng = random.Random(5)
    docs = [[rng.randrange(512) for _ in range(64)] for _ in range(6)]
    prompts = [doc + [rng.randrange(512) for _ in range(3)] for _ in range(3) for doc in docs]
    expected = reference_outputs("tiny-llama", prompts, 4)
    # (32-token steps: the store's I/O thread writes a document's blocks while its questions wait)
    with tiered_llm(tmp_path, scheduler={"cost_model": LOAD_WINS, "scheduling_policy": "fcfs",
                                         "max_num_batched_tokens": 32}) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["nvme_loaded_blocks"] > 0 and stats["nvme_failed_loads"] == 0


def test_a_request_waiting_on_its_loads_is_not_matched_again_each_step(tmp_path, reference_outputs, monkeypatch):
    # a slow disk: the load-only request waits many steps for its reads; re-matching its whole
    # prompt at each of them made the wait O(prompt) a step, and starved the I/O threads
    from tieredkv.tiers.nvme import store as nvme

    prompt = [(i * 37) % 509 + 3 for i in range(400)]
    expected = reference_outputs("tiny-llama", [prompt], NEW_TOKENS)
    with tiered_llm(tmp_path, num_gpu_blocks=120, cpu_cache_bytes=256 * BLOCK_BYTES) as llm:
        for p in (prompt, prompt[::-1], prompt[::2] * 2):  # the last two push it down to the CPU tier
            llm.generate([p], GREEDY, use_tqdm=False)
    # (closing wrote the CPU tier to disk)
    real_make_backend = nvme.make_backend

    def slow_backend(*args, **kwargs):  # the completion thread takes 1 ms more for each completion
        backend = real_make_backend(*args, **kwargs)
        reap = backend.reap

        def slow_reap(timeout):
            done = reap(timeout)
            time.sleep(0.001 * len(done))
            return done

        backend.reap = slow_reap
        return backend

    monkeypatch.setattr(nvme, "make_backend", slow_backend)
    load_only = {**LOAD_WINS, "prefill_s_per_token": 1e3}
    with tiered_llm(tmp_path, cost_model=load_only, num_gpu_blocks=120, cpu_cache_bytes=128 * BLOCK_BYTES) as llm:
        matches = 0
        match_prefix = llm.kv.match_prefix

        def counted(seq):
            nonlocal matches
            matches += 1
            return match_prefix(seq)

        llm.kv.match_prefix = counted
        outs = llm.generate([prompt], GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["nvme_loaded_blocks"] > 50
    # planned, found waiting, matched once more when its blocks had landed; waiting all along
    assert matches <= 4 < stats["nvme_load_waits"]


def test_blocks_read_back_from_disk_are_evicted_before_those_admission_kept(tmp_path, reference_outputs):
    # a document read back for one request must not push out of the (frequency-admitted) CPU
    # tier the blocks it chose to keep: they are on disk, cheap to read again
    doc = [(i * 37) % 509 + 3 for i in range(400)]
    chat = [(i * 11) % 499 + 7 for i in range(120)]
    expected = reference_outputs("tiny-llama", [chat, doc], NEW_TOKENS)
    with tiered_llm(tmp_path, num_gpu_blocks=120, cpu_cache_bytes=256 * BLOCK_BYTES) as llm:
        for p in (doc, doc[::-1], doc[::2] * 2):  # the last two push it down to the CPU tier
            llm.generate([p], GREEDY, use_tqdm=False)
    load_only = {**LOAD_WINS, "prefill_s_per_token": 1e3}
    with tiered_llm(tmp_path, cost_model=load_only, cpu_policy="tinylfu", num_gpu_blocks=120,
                    cpu_cache_bytes=160 * BLOCK_BYTES) as llm:
        outs = [llm.generate([chat], GREEDY, use_tqdm=False)[0] for _ in range(2)]  # asked for twice
        outs += llm.generate([doc], GREEDY, use_tqdm=False)  # read back; pushes the chat down to the CPU tier
        stats = llm.stats()
        pool = llm.kv.offload.pool
        read_back = {b.block_id for b in pool.cold_blocks() if b.evict_first}
        # ahead of every kept block the disk lacks (kept blocks written ahead to disk go back to
        # the front too: evicting them loses nothing)
        lower = llm.kv.offload.lower
        order = [b.block_id in read_back for b in pool.cold_blocks()
                 if b.block_id in read_back or not lower.contains(b.block_hash)]
    assert [o.token_ids for o in outs] == [expected[0], expected[0], expected[1]]
    assert stats["nvme_loaded_blocks"] > 50 and stats["cpu_demoted_blocks"] > 0
    assert len(read_back) > 50 and order == sorted(order, reverse=True)  # all of them first in line
    assert order.count(False) > 0


def test_a_policy_set_on_the_scheduler_is_the_one_loads_are_planned_by(tmp_path, reference_outputs):
    """Benchmarks force load-only or recompute-only by setting the scheduler's policy: the load
    planner follows it as given, not its own policy with the rate it learned."""
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
    recompute_wins = {**LOAD_WINS, "disk_read_bytes_per_s": 1.0}
    with tiered_llm(tmp_path, cost_model=recompute_wins) as llm:
        llm.scheduler.policy = dataclasses.replace(llm.scheduler.policy, cost=CostModel(**LOAD_WINS))
        assert llm.scheduler.loads.policy is llm.scheduler.policy
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert llm.stats()["nvme_loaded_blocks"] > 0
