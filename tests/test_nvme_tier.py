"""The NVMe tier inside the engine: exact tokens when prefixes come back from disk, after a
restart, with every I/O backend, and when the disk misbehaves."""

from __future__ import annotations

import os

import pytest

from tests.reference import make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.tiers.nvme import STORE_FILE_NAME

NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
BLOCK_BYTES = 8192  # tiny-llama, block size 4, float32


def tiered_llm(path, backend: str = "sync", **kw) -> LLM:
    """GPU and CPU tiers so small that most prefixes end up on NVMe."""
    return LLM(model="tiny-llama", block_size=4, num_gpu_blocks=30, cpu_cache_bytes=24 * BLOCK_BYTES,
               nvme_path=str(path), nvme_bytes="4MiB", io_backend=backend, preemption="recompute", **kw)


@pytest.mark.parametrize("backend", ["sync", "aiofiles", "uring"])
def test_prefixes_come_back_from_nvme_after_restart(tmp_path, backend, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path, backend) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        assert llm.stats()["nvme_spilled_blocks"] > 0
    # a new engine on the same path finds what the first one spilled
    with tiered_llm(tmp_path, backend) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        stats = llm.stats()
    assert stats["nvme_loaded_blocks"] > 0 and stats["nvme_failed_loads"] == 0


def test_another_model_never_reuses_the_store(tmp_path, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    with tiered_llm(tmp_path) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiered_llm(tmp_path, seed=1) as llm:  # other weights: another fingerprint
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["nvme_loaded_blocks"] == 0
    with tiered_llm(tmp_path) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def damage_payloads(path) -> int:
    """Flip one byte in the middle of every slot's payload area; returns how many."""
    file = os.path.join(path, STORE_FILE_NAME)
    size = os.path.getsize(file)
    slot = 4096 + BLOCK_BYTES  # header page + payload
    count = 0
    with open(file, "r+b") as f:
        for offset in range(4096 + BLOCK_BYTES // 2, size, slot):
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
    file = os.path.join(tmp_path, STORE_FILE_NAME)
    if damage == "flip":
        assert damage_payloads(tmp_path) > 0
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
