"""The engine's lower tier when things go wrong at the edges: a small CPU tier still stages
writes for a restart, a lost store file on a full disk lets go of its space and memory and comes
back when it can, a store in use says who holds it, idle stats count no block as used, and a
disk that hangs costs recomputes and lets the engine close.

A full disk is a real one here: a tmpfs of a few MiB mounted for the test (skipped where
mounting is not allowed); a file that cannot be made uses RLIMIT_FSIZE, as test_nvme_hardening."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time

import pytest

from tests.reference import make_prompts, settle_writes
from tests.test_nvme_hardening import file_size_limit
from tieredkv import LLM, SamplingParams
from tieredkv.tiers.nvme import STORE_FILE_NAME

BLOCK_BYTES = 2048  # tiny-llama, block size 4, float32
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
LOAD_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1e-3,
             "disk_read_bytes_per_s": 1e15}


def tiny_llm(path, cpu_blocks: int, **kw) -> LLM:
    kw = {"num_gpu_blocks": 20, "nvme_bytes": "1MiB", "cpu_policy": "lru", "preemption": "recompute",
          "scheduler": {"cost_model": LOAD_WINS}, "io_backend": "sync", **kw}
    return LLM(model="tiny-llama", block_size=4, cpu_cache_bytes=cpu_blocks * BLOCK_BYTES, nvme_path=str(path), **kw)


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


# ------------------------------------------------------------------ 2: a small CPU tier


def test_a_restart_finds_blocks_staged_by_a_cpu_tier_of_four_blocks(tmp_path, reference_outputs):
    # frequency admission turns down most demotions of a 4-block tier: those worth keeping go to
    # disk through its one staging block (a tier under 16 blocks had none, so a restart found
    # nothing). The first engine only writes (a disk too slow to read: no read to give way to)
    # and asks for each prompt four times (a staged demotion is dropped while the block's last
    # write is in flight)
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    write_only = {"cost_model": {**LOAD_WINS, "disk_read_bytes_per_s": 1.0}}
    with tiny_llm(tmp_path, 4, cpu_policy="tinylfu", scheduler=write_only) as llm:
        for _ in range(4):
            assert tokens(llm, prompts) == expected
        stats = llm.stats()
        assert stats["nvme_staged_blocks"] > 0
        # every demotion copied is kept in the tier or passes through a staging block: counted once
        assert stats["bytes_d2h"] == (stats["cpu_demoted_blocks"] + stats["nvme_staged_blocks"]) * BLOCK_BYTES
    with tiny_llm(tmp_path, 4, cpu_policy="tinylfu") as llm:
        assert tokens(llm, prompts) == expected
        stats = llm.stats()
    assert stats["nvme_hits"] > 0 and stats["nvme_loaded_blocks"] > 0 and stats["nvme_failed_loads"] == 0


# ------------------------------------------------------------------ 3: a lost store on a full disk


@contextlib.contextmanager
def small_disk(path, nbytes: int):
    """A tmpfs of `nbytes` mounted at `path` (skips the test where mounting is not allowed)."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path) -> None:
    """Write a file at `path` until the disk is full."""
    with open(path, "ab") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()


def deleted_files_open(folder) -> list[str]:
    """Files under `folder` this process holds open although they were deleted."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(folder)) and target.endswith("(deleted)"):
                out.append(target)
    return out


def short_back_offs(monkeypatch) -> None:
    """Failed writes pause spilling, and a store that cannot make its file waits, 0.1, 0.2, then
    0.4 s (not 1 s up to a minute)."""
    from tieredkv.cache import spill
    from tieredkv.tiers.nvme import file_keeper

    for module, name in ((spill, "PAUSE"), (file_keeper, "REOPEN")):
        monkeypatch.setattr(module, f"{name}_FIRST_S", 0.1, raising=False)
        monkeypatch.setattr(module, f"{name}_MAX_S", 0.4, raising=False)


def test_a_store_deleted_on_a_full_disk_is_closed_and_made_again(tmp_path, reference_outputs, monkeypatch):
    short_back_offs(monkeypatch)
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with small_disk(tmp_path / "disk", 4 << 20) as disk, tiny_llm(disk / "kv", 16) as llm:
        fill(disk / "filler")
        assert tokens(llm, prompts) == expected
        written = settle_writes(llm)["nvme_spilled_blocks"]
        assert written > 0
        os.remove(disk / "kv" / STORE_FILE_NAME)
        # the next submit notices; the lost file is closed once its jobs ended, which gives its
        # space back, and a new file takes it
        assert tokens(llm, prompts) == expected
        deadline, seed = time.monotonic() + 10, 1
        while not (disk / "kv" / STORE_FILE_NAME).exists() and time.monotonic() < deadline:
            # made by the I/O side for a write after the loss (once the lost file's last job
            # ended, else after a back-off): new prompts give new blocks to write
            tokens(llm, make_prompts(vocab_size=512, seed=seed))
            seed += 1
        assert deleted_files_open(disk) == []
        assert (disk / "kv" / STORE_FILE_NAME).exists()
        assert llm.kv.offload.lower.store.sync()
        stats = settle_writes(llm)
        assert stats["nvme_files_lost"] == 1 and stats["nvme_spilled_blocks"] > written
        assert stats["cpu_blocks_used"] == 0 and stats["nvme_write_backlog"] == 0


def test_a_store_that_cannot_be_made_again_backs_off_and_holds_nothing(tmp_path, reference_outputs, monkeypatch,
                                                                        caplog):
    short_back_offs(monkeypatch)
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiny_llm(tmp_path / "kv", 16) as llm, caplog.at_level(logging.INFO, logger="tieredkv"):
        assert tokens(llm, prompts) == expected
        os.remove(tmp_path / "kv" / STORE_FILE_NAME)
        def failures() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "cannot make a new file" in r.getMessage()]

        with file_size_limit(64 << 10):  # a new 1 MiB store file cannot be made (EFBIG, as a full disk)
            # writes into the lost file fail too and pause spilling: requests go on until a
            # submit finds the file lost and tries to make a new one (how many depends on timing)
            deadline, seed = time.monotonic() + 10.0, 0
            while not failures() and time.monotonic() < deadline:
                seed += 1
                assert tokens(llm, make_prompts(vocab_size=512, seed=seed)) is not None
            idle = llm.stats()
            for _ in range(20):
                llm.step()
            stats = llm.stats()
            # one try per back-off (0.4 s by now), not one each step (a window of writes each)
            assert stats["nvme_io_errors"] - idle["nvme_io_errors"] <= 1
            assert stats["nvme_write_backlog"] == 0 and stats["cpu_blocks_used"] == 0  # nothing held
            assert not (tmp_path / "kv" / STORE_FILE_NAME).exists()
        def said(text: str) -> int:
            return sum(text in r.getMessage() for r in caplog.records)

        # said once, however often retried; a pause is said again only after writes succeeded
        # (writes at the lost file's first 64 KiB still may, as timing has it)
        assert len(failures()) == 1 and said("spilling pauses") <= said("spilling resumes") + 1
        time.sleep(0.5)  # the limit is gone: after the back-off, the store is made again
        assert tokens(llm, prompts) == expected
        llm.kv.offload.lower.store.sync()
        llm.step()
        assert (tmp_path / "kv" / STORE_FILE_NAME).exists()
        assert llm.stats()["nvme_slots_used"] > 0


# ------------------------------------------------------------------ 4: a store in use


def test_a_second_engine_on_the_same_store_is_a_config_error_naming_the_holder(tmp_path):
    with tiny_llm(tmp_path, 16):
        with pytest.raises(ValueError, match=rf"cache\.nvme_path: .* in use by another engine \(this process, "
                                             rf"pid {os.getpid()}\)"):
            tiny_llm(tmp_path, 16)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(tmp_path / STORE_FILE_NAME)!r}, os.O_RDWR)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"cache\.nvme_path: .* in use by another engine \(process "
                                             rf"{holder.pid}\)"):
            tiny_llm(tmp_path, 16)
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ 5: idle stats


def test_an_idle_engine_uses_no_cpu_block_and_reports_its_staging_blocks(tmp_path):
    with tiny_llm(tmp_path, 32) as llm:  # the demo's CPU tier: 32 blocks
        stats = llm.stats()
    assert stats["cpu_blocks_total"] == 32
    assert stats["cpu_blocks_used"] == 0 and stats["cpu_blocks_staging"] == 2  # 1/16 of the tier
    assert stats["nvme_spills_dropped"] == 0


# ------------------------------------------------------------------ a disk that hangs


def test_a_disk_that_hangs_costs_recomputes_and_the_engine_still_closes(tmp_path, reference_outputs, monkeypatch):
    from tests.test_nvme_store import GatedBackend
    from tieredkv.cache import lower_tier, spill
    from tieredkv.tiers.nvme import store

    gated = GatedBackend()
    monkeypatch.setattr(store, "make_backend", lambda *args: gated)
    monkeypatch.setattr(lower_tier, "STALLED_READ_S", 0.3)
    monkeypatch.setattr(spill, "CLOSING_WAIT_S", 0.5)
    monkeypatch.setattr(store, "CLOSE_STALL_S", 0.5)
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = tiny_llm(tmp_path, 8, num_gpu_blocks=24)
    try:
        for _ in range(3):  # asked for again and again: worth writing down
            assert tokens(llm, prompts) == expected
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
        llm.reset_prefix_cache()  # the prompts' blocks are on disk only
        gated.gate.clear()  # from now on the disk answers nothing
        assert tokens(llm, prompts) == expected  # the reads it hangs on are given up and computed
        assert llm.stats()["nvme_stalled_loads"] > 0
        start = time.monotonic()
        llm.close()  # writes down what it can, and does not wait for the disk for ever
        assert time.monotonic() - start < 5.0
    finally:
        gated.release()  # the I/O left behind finishes: the store's threads end


def test_reads_reached_before_they_land_are_computed_exactly(tmp_path, reference_outputs, monkeypatch):
    """In arrival order a short prompt's two blocks are planned to load behind a long prompt's
    reads and prefill; chunked prefill runs it beside that prefill, so it reaches them with the
    disk answering nothing: computing them beats the reads queued ahead, and it does (the long
    prompt waits for its own reads, given up as stalled). Both exact."""
    from tests.test_nvme_store import GatedBackend
    from tieredkv.cache import lower_tier
    from tieredkv.tiers.nvme import store

    backends: list[GatedBackend] = []  # one for each engine's store
    monkeypatch.setattr(store, "make_backend", lambda *args: backends.append(GatedBackend()) or backends[-1])
    monkeypatch.setattr(lower_tier, "STALLED_READ_S", 0.5)
    prompts = [list(range(3, 73)), list(range(100, 109))]  # 17 full blocks, then 2
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with tiny_llm(tmp_path, 64, num_gpu_blocks=24) as first:
        assert tokens(first, prompts) == expected
        for filler in [list(range(200 + 70 * i, 270 + 70 * i)) for i in range(3)]:
            tokens(first, [filler])  # both prompts' blocks go down to the CPU tier, written down at close
    costs = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1e-3,
             "disk_read_bytes_per_s": BLOCK_BYTES / 2e-3}  # a block read in 2 ms, computed in 4
    llm = tiny_llm(tmp_path, 64, num_gpu_blocks=48, max_num_batched_tokens=16,
                   scheduler={"cost_model": costs, "scheduling_policy": "fcfs"})
    gated = backends[-1]
    try:
        gated.gate.clear()  # from now on the disk answers nothing
        assert tokens(llm, prompts) == expected
        stats = llm.stats()
        assert stats["nvme_prefix_blocks"]["load"] > 2  # the long prompt planned loads too
        assert stats["nvme_late_loads"] == 2 and stats["nvme_stalled_loads"] > 0
    finally:
        gated.release()
        llm.close()
