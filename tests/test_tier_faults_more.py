"""More faults of the tiers below the CPU tier while the engine serves, injected through files and
processes: each costs a recompute, never a wrong token, a lost request, a hang or a crash, and the
tier is used again once it can be.

The engine runs tiny-llama with GPU and CPU tiers too small for the prompts (as test_tier_faults),
so blocks go down to the store (a real file) or the server (a real redis-server) and come back;
tokens are compared with transformers' greedy ones."""

from __future__ import annotations

import logging
import os
import time

import pytest

from tests.reference import make_prompts, settle_writes
from tests.test_nvme_hardening import file_size_limit
from tests.test_tier_hardening import NEW_TOKENS, short_back_offs, tiny_llm, tokens
from tieredkv.tiers.nvme import STORE_FILE_NAME
from tieredkv.tiers.nvme.file_keeper import LOOK_EVERY_S


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


def stored_anew(stats: dict) -> bool:
    """The store lost its file once and holds blocks again (in the file made since)."""
    return stats["nvme_files_lost"] == 1 and stats["nvme_slots_used"] > 0


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
        time.sleep(LOOK_EVERY_S)  # the next submit looks at the file
        llm.reset_prefix_cache()
        assert tokens(llm, prompts) == expected  # its reads fail: recomputed
        deadline, seed = time.monotonic() + 10, 1
        while not stored_anew(settle_writes(llm)) and time.monotonic() < deadline:
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


def test_a_store_file_that_cannot_be_formatted_again_is_let_go_and_made_later(tmp_path, expected, monkeypatch,
                                                                             caplog):
    # remaking the lost file opened and locked it, then failed to write its superblock: the open
    # file was kept (with its lock), so every later try found the file "used by another
    # NVMeStore (this process)" and the store stored nothing for the rest of the run
    short_back_offs(monkeypatch)
    prompts = make_prompts(vocab_size=512)
    store_file = tmp_path / "kv" / STORE_FILE_NAME

    def failures() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cannot make a new file" in r.getMessage()]

    with tiny_llm(tmp_path / "kv", 16) as llm, caplog.at_level(logging.INFO, logger="tieredkv"):
        assert tokens(llm, prompts) == expected
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
        os.close(descriptors_of(store_file)[0])  # the store makes its file again: the same one, full size
        with file_size_limit(0):  # it opens and locks it (no growth), and cannot write its superblock
            deadline, seed = time.monotonic() + 10, 1
            while not failures() and time.monotonic() < deadline:
                tokens(llm, make_prompts(vocab_size=512, seed=seed))  # new blocks to write
                seed += 1
        assert len(failures()) == 1 and "used by another" not in failures()[0]
        assert descriptors_of(store_file) == []  # let go of
        deadline = time.monotonic() + 10
        while not stored_anew(settle_writes(llm)) and time.monotonic() < deadline:
            tokens(llm, make_prompts(vocab_size=512, seed=seed))  # after a back-off, the store tries again
            seed += 1
        stats = settle_writes(llm)
        assert stats["nvme_files_lost"] == 1 and stats["nvme_slots_used"] > 0
        assert len(descriptors_of(store_file)) == 1
        llm.reset_prefix_cache()
        assert tokens(llm, prompts) == expected
