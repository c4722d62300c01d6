"""More faults of the tiers below the CPU tier while the engine serves, injected through files and
processes: each costs a recompute, never a wrong token, a lost request, a hang or a crash, and the
tier is used again once it can be.

The engine runs tiny-llama with GPU and CPU tiers too small for the prompts (as test_tier_faults),
so blocks go down to the store (a real file) or the server (a real redis-server) and come back;
tokens are compared with transformers' greedy ones."""

from __future__ import annotations

import os
import time

import pytest

from tests.reference import make_prompts, settle_writes
from tests.test_tier_hardening import NEW_TOKENS, short_back_offs, tiny_llm, tokens
from tieredkv.tiers.nvme import STORE_FILE_NAME


@pytest.fixture
def expected(reference_outputs):
    return reference_outputs("tiny-llama", make_prompts(vocab_size=512), NEW_TOKENS)


def descriptors_of(path) -> list[int]:
    """The descriptors this process holds open on the file at `path`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                found.append(int(fd))
        except OSError:  # the descriptor listing the folder itself, gone by now
            pass
    return found


# ------------------------------------------------------------------ NVMe


def test_a_store_descriptor_closed_under_it_is_replaced_and_the_engine_still_closes(tmp_path, expected,
                                                                                     monkeypatch):
    # the store held on to a descriptor someone closed: every read and write failed with EBADF for
    # the rest of the run (nothing stored again), and close() raised OSError from os.close
    short_back_offs(monkeypatch)
    prompts = make_prompts(vocab_size=512)
    llm = tiny_llm(tmp_path / "kv", 16)
    try:
        assert tokens(llm, prompts) == expected
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
        fds = descriptors_of(tmp_path / "kv" / STORE_FILE_NAME)
        assert len(fds) == 1
        os.close(fds[0])
        llm.reset_prefix_cache()
        assert tokens(llm, prompts) == expected  # its reads fail: recomputed
        deadline, seed = time.monotonic() + 10, 1
        while settle_writes(llm)["nvme_slots_used"] == 0 and time.monotonic() < deadline:
            tokens(llm, make_prompts(vocab_size=512, seed=seed))  # new blocks to write
            seed += 1
        stats = settle_writes(llm)
        assert stats["nvme_files_lost"] == 1 and stats["nvme_slots_used"] > 0
        assert len(descriptors_of(tmp_path / "kv" / STORE_FILE_NAME)) == 1  # opened anew
        hits = stats["nvme_hits"]
        assert tokens(llm, prompts) == expected
        settle_writes(llm)
        llm.reset_prefix_cache()
        assert tokens(llm, prompts) == expected
        assert llm.stats()["nvme_hits"] > hits  # the store serves again
    finally:
        llm.close()
