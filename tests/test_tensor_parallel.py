"""Tensor parallelism on the CPU (gloo): two rank processes give exactly transformers' tokens
under swap, recompute, NVMe spill and after a restart; a rank that dies stops the engine with
a clear error instead of hanging it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tests.reference import hf_greedy, make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.cache.spill import STAGING_FRACTION
from tieredkv.config import EngineConfig
from tieredkv.experiment.harness import run_experiment
from tieredkv.experiment.restart import _empty_store
from tieredkv.parallel.ranks import RankFailure
from tieredkv.parallel.sharded_tiers import rank_fingerprint
from tieredkv.tiers.nvme import STORE_FILE_NAME, NVMeStore

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
SWAP_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1.0,
             "disk_read_bytes_per_s": 1e15}
LOAD_WINS = {**SWAP_WINS, "prefill_s_per_token": 1e-3}
# tiny-llama, block size 4, float32, both ranks: 2 layers x K/V x 4 tokens x 2 heads x 16 dims x 4 B
BLOCK_BYTES = 2048


def tp_llm(model: str, nvme_path, preemption: str, cost_model: dict, device: str = "cpu", **kw) -> LLM:
    """Two ranks; GPU and CPU tiers so small that requests are preempted and prefixes spill to
    NVMe all the time."""
    return LLM(model=model, device=device, dtype="float32", tensor_parallel_size=2, block_size=4,
               num_gpu_blocks=30, max_num_batched_tokens=24, cpu_cache_bytes=24 * BLOCK_BYTES,
               nvme_path=str(nvme_path), nvme_bytes="4MiB", io_backend="sync", preemption=preemption,
               scheduler={"cost_model": cost_model}, **kw)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-mistral"])
def test_two_ranks_are_exact_under_swap_recompute_spill_and_restart(preset, tmp_path, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs(preset, prompts, NEW_TOKENS)
    with tp_llm(preset, tmp_path, "swap", SWAP_WINS) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        llm.kv.offload.drain()  # the last demotions' CPU blocks are released
        stats, fingerprint = llm.stats(), llm.fingerprint
    assert stats["preemptions"]["swap"] > 0 and stats["bytes_d2h"] > 0 and stats["bytes_h2d"] > 0
    assert stats["nvme_spilled_blocks"] > 0
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] <= held_by_spill(stats)
    assert sorted(os.listdir(tmp_path)) == ["tp2-rank0", "tp2-rank1"]  # one store file per rank
    check_store_layout(tmp_path, preset, fingerprint)

    # a new engine on the same path reads the prefixes back from both ranks' files
    with tp_llm(preset, tmp_path, "recompute", LOAD_WINS) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["preemptions"]["recompute"] > 0 and stats["preemptions"]["swap"] == 0
    assert stats["nvme_restored"] > 0
    assert stats["nvme_loaded_blocks"] > 0 and stats["nvme_failed_loads"] == 0


def held_by_spill(stats: dict) -> int:
    """CPU blocks the NVMe spill holds with no request running and no transfer left: its
    staging blocks and the blocks being written."""
    return min(256, stats["cpu_blocks_total"] // STAGING_FRACTION) + stats["nvme_write_backlog"]


def check_store_layout(path, preset: str, fingerprint: int) -> None:
    """Rank 0's file opens under rank 0's fingerprint only: not rank 1's, not one process's."""
    with LLM(model=preset, device="cpu", dtype="float32", block_size=4, num_gpu_blocks=8) as one_process:
        assert one_process.fingerprint != fingerprint
    for key, restored in [(rank_fingerprint(fingerprint, 0), True), (rank_fingerprint(fingerprint, 1), False),
                          (one_process.fingerprint, False)]:
        copy = path.parent / f"copy-{key:x}"
        shutil.copytree(path / "tp2-rank0", copy)
        with NVMeStore(copy / STORE_FILE_NAME, 2 << 20, store_block_bytes(preset), key, 4, backend="sync") as store:
            assert (store.stats()["restored"] > 0) == restored


def test_a_restart_that_empties_the_store_removes_every_ranks_file(tmp_path):
    """The warm-restart experiment's "empty" store at two ranks: both rank files go."""
    sizes = []
    for rank in range(2):
        with NVMeStore(tmp_path / f"tp2-rank{rank}", 1 << 20, BLOCK_BYTES // 2, rank, 4, backend="sync"):
            pass
        sizes.append(os.path.getsize(tmp_path / f"tp2-rank{rank}" / STORE_FILE_NAME))
    assert _empty_store(str(tmp_path)) == sum(sizes) > 0
    assert not any((tmp_path / f"tp2-rank{rank}" / STORE_FILE_NAME).exists() for rank in range(2))


def store_block_bytes(preset: str) -> int:
    """One rank's bytes of a block (block size 4, float32): tiny-qwen3 keeps one KV head of 32
    dims per rank (replicated), the others one of their two heads of 16 dims."""
    return 2 * 2 * 4 * (32 if preset == "tiny-qwen3" else 16) * 4


def test_a_damaged_slice_on_one_rank_is_a_miss_for_the_block_on_both(tmp_path, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tp_llm("tiny-llama", tmp_path, "recompute", LOAD_WINS) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        geometry = llm.kv.offload.lower.store.stores[1].geometry
    flip_payloads(tmp_path / "tp2-rank1" / STORE_FILE_NAME, geometry)  # rank 0's file is intact
    with tp_llm("tiny-llama", tmp_path, "recompute", LOAD_WINS) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["nvme_failed_loads"] > 0 and stats["nvme_corrupt"] > 0
    # no block of the damaged file came back (each lost its rank-1 half): those that did were
    # written again by this run, after the damage
    assert stats["nvme_loaded_blocks"] <= stats["nvme_spilled_blocks"]


def flip_payloads(file, geometry) -> None:
    """Flip one byte in the middle of every slot's payload."""
    with open(file, "r+b") as f:
        for slot in range(geometry.num_slots):
            f.seek(geometry.slot_offset(slot) + geometry.header_bytes + geometry.block_bytes // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


def test_a_model_directory_at_two_ranks_gives_the_tokens_and_text_of_one(chat_model_dir):
    """Loaded from a directory, cut by rank: greedy tokens equal transformers', and a seeded
    random sample and the text equal those of one process."""
    prompts = ["the cache block", "tier offload swap recompute prefix token model"]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    reference = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    with LLM(model=chat_model_dir, device="cpu", dtype="float32", num_gpu_blocks=64) as llm:
        ids = [llm.tokenize(p) for p in prompts]
        one = llm.generate(prompts, [GREEDY, seeded], use_tqdm=False)
    with LLM(model=chat_model_dir, device="cpu", dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2) as llm:
        two = llm.generate(prompts, [GREEDY, seeded], use_tqdm=False)
        again = llm.generate(prompts[1], seeded, use_tqdm=False)[0]
    with torch.inference_mode():
        assert two[0].token_ids == hf_greedy(reference, ids[0], NEW_TOKENS)
    assert [(o.token_ids, o.text) for o in two] == [(o.token_ids, o.text) for o in one]
    assert again.token_ids == two[1].token_ids


def run_with_deadline(fn, seconds: float):
    """`fn()` in a thread; its exception (or result); fails the test if it is still running."""
    out: dict = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as err:  # handed to the test
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: the engine hangs"
    return out.get("error", out.get("result"))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(") ")[-1].startswith("Z")


def test_a_killed_rank_stops_the_engine_with_a_clear_error():
    llm = LLM(model="tiny-llama", device="cpu", dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2)
    pids = llm.runner.pids
    llm.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    llm.step()
    os.kill(pids[1], signal.SIGKILL)
    err = run_with_deadline(llm.step, 60)
    assert isinstance(err, RankFailure), err
    assert f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in str(err)
    assert "create a new LLM" in str(err)
    assert all(gone(pid) for pid in pids)  # rank 0, stuck in a collective with rank 1, was stopped too
    with pytest.raises(RankFailure, match="rank 1 .* was killed by SIGKILL"):
        llm.step()
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2]], use_tqdm=False)


def test_a_rank_killed_during_generate_ends_it_with_the_error():
    llm = LLM(model="tiny-llama", device="cpu", dtype="float32", num_gpu_blocks=256, tensor_parallel_size=2,
              cpu_cache_bytes="1MiB", preemption="swap")
    pids = llm.runner.pids
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    killer = threading.Thread(target=lambda: (wait_for_steps(llm, 3), os.kill(pids[0], signal.SIGKILL)))
    killer.start()
    err = run_with_deadline(lambda: llm.generate(make_prompts(vocab_size=512), params, use_tqdm=False), 120)
    killer.join()
    assert isinstance(err, RankFailure), err
    assert f"rank 0 (pid {pids[0]}) was killed by SIGKILL" in str(err)
    assert all(gone(pid) for pid in pids)
    stats = llm.stats()  # the driver's bookkeeping is intact: the batch gave its blocks back
    assert stats["gpu_blocks_used"] == 0 and stats["requests_running"] == 0
    llm.close()


def fail_on_rank_1(worker) -> None:
    if worker.rank == 1:
        raise RuntimeError("boom")


def test_an_error_on_one_rank_stops_every_rank_and_names_it():
    llm = LLM(model="tiny-llama", device="cpu", dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2)
    pids = llm.runner.pids
    with pytest.raises(RankFailure, match="rank 1 failed: RuntimeError: boom"):
        llm.runner.ranks.call("apply", fail_on_rank_1)
    assert all(gone(pid) for pid in pids)
    with pytest.raises(RankFailure, match="ranks have stopped: tensor-parallel rank 1 failed"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    llm.close()


def wait_for_steps(llm: LLM, steps: int) -> None:
    while llm.stats()["steps"] < steps:
        time.sleep(0.01)


def test_settings_the_model_or_the_ranks_cannot_take_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's 4 attention heads"):
        LLM(model="tiny-llama", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size: expected an integer >= 1, got 0"):
        LLM(model="tiny-qwen3", device="cpu", tensor_parallel_size=0)
    # found by the ranks (each checks its own memory): the caller's ValueError all the same
    with pytest.raises(ValueError, match="num_gpu_blocks: 1000000000 blocks of 1024 bytes need"):
        LLM(model="tiny-llama", device="cpu", block_size=4, num_gpu_blocks=10**9, tensor_parallel_size=2)


def test_tensor_parallel_size_in_yaml_and_keywords():
    assert EngineConfig.from_dict({"parallel": {"tensor_parallel_size": 2}}).parallel.tensor_parallel_size == 2
    assert EngineConfig.from_dict({"tensor_parallel_size": "2"}).parallel.tensor_parallel_size == 2
    assert EngineConfig.from_kwargs(tensor_parallel_size=2).parallel.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="did you mean 'parallel.tensor_parallel_size'"):
        EngineConfig.from_dict({"parallel": {"tensor_paralel_size": 2}})


def test_an_experiment_runs_at_two_ranks(tmp_path):
    """The experiment harness drives the two ranks through AsyncLLM (each step in a thread)."""
    config = {
        "name": "tp", "model": "tiny-llama", "device": "cpu", "dtype": "float32", "tensor_parallel_size": 2,
        "cache": {"block_size": 4, "num_gpu_blocks": 48, "cpu_cache_bytes": "128KiB"},
        "scheduler": {"max_num_batched_tokens": 64, "preemption": "swap"},
        "workload": {"kind": "multi_turn", "users": 3, "turns": 2, "system_prompt_tokens": 20, "message_tokens": 6,
                     "first_message_tokens": 30, "max_tokens": 4, "think_time_s": 0.01},
    }
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(config))
    [summary] = run_experiment(str(path), str(tmp_path / "out"), use_tqdm=False).summaries
    assert summary.requests == 6 and summary.errors == 0
    result = json.loads((tmp_path / "out" / "tp" / "result.json").read_text())
    assert result["engine"]["config"]["parallel"] == {"tensor_parallel_size": 2, "all_reduce": "auto"}
    assert all(len(r["token_times"]) == 4 for r in result["requests"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_two_gpus_are_exact_with_swap_spill_and_restart(preset, enforce_eager, tmp_path, reference_outputs):
    """NCCL: the collectives inside CUDA graphs (decode and mixed steps), the CUDA transfer
    engine of each rank with its pinned slice of the shared CPU tier, a store per rank."""
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs(preset, prompts, NEW_TOKENS)  # transformers, float32, CPU
    kw = dict(device="cuda", enforce_eager=enforce_eager)
    with tp_llm(preset, tmp_path, "swap", SWAP_WINS, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        llm.kv.offload.drain()
        stats = llm.stats()
    assert stats["preemptions"]["swap"] > 0 and stats["nvme_spilled_blocks"] > 0
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] <= held_by_spill(stats)
    with tp_llm(preset, tmp_path, "recompute", LOAD_WINS, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["nvme_loaded_blocks"] > 0 and stats["nvme_failed_loads"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_killed_rank_on_a_gpu_stops_the_engine():
    """The survivor waits in an NCCL collective that never completes: the engine ends it."""
    llm = LLM(model="tiny-llama", device="cuda", num_gpu_blocks=64, tensor_parallel_size=2)
    pids = llm.runner.pids
    llm.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    llm.step()
    os.kill(pids[1], signal.SIGKILL)
    err = run_with_deadline(llm.step, 60)
    assert isinstance(err, RankFailure) and f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in str(err)
    assert all(gone(pid) for pid in pids)
    llm.close()
