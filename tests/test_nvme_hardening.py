"""The NVMe store and the disk it lives on: a store that does not fit is refused before it takes
any space, a failed creation leaves nothing behind, user files and links are never written,
corruption found at start-up is logged and counted, calibration copes with a full disk.

A full disk is simulated with RLIMIT_FSIZE: the kernel then fails writes and fallocate past the
limit with EFBIG, exactly where a full disk fails them with ENOSPC, and nothing fills the real
disk even if a check is missing."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import shutil

import pytest

from tests.reference import settle_writes
from tests.test_nvme_store import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    FP,
    cpu_pool,
    fill,
    slots_capacity,
    write_all,
)
from tieredkv import LLM, SamplingParams
from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.nvme import STORE_FILE_NAME, NVMeStore
from tieredkv.tiers.nvme.block_io import IOCompletion
from tieredkv.tiers.nvme.io_backends import SyncBackend
from tieredkv.tiers.nvme.slot_format import SUPERBLOCK_BYTES

TINY_BLOCK_BYTES = 2048  # tiny-llama, block size 4, float32
LOAD_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1e-3,
             "disk_read_bytes_per_s": 1e15}


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes and fallocate past `nbytes` fail with EFBIG in this process (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def make_store(path, num_slots: int = 8, backend="sync", **kw) -> NVMeStore:
    return NVMeStore(path, slots_capacity(num_slots), BLOCK_BYTES, FP, BLOCK_SIZE, backend=backend, **kw)


def tiered_llm(path, nvme_bytes="4MiB", **kw) -> LLM:
    kw.setdefault("preemption", "recompute")
    kw.setdefault("scheduler", {"cost_model": LOAD_WINS})
    kw.setdefault("block_size", 4)
    return LLM(model="tiny-llama", num_gpu_blocks=30, cpu_cache_bytes=24 * TINY_BLOCK_BYTES,
               nvme_path=str(path), nvme_bytes=nvme_bytes, io_backend="sync", **kw)


# ------------------------------------------------------------------ 7: free space


def test_a_store_larger_than_the_free_space_is_refused_before_allocating(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with file_size_limit(64 << 20), pytest.raises(OSError, match="free") as info:
        make_store(tmp_path / "kv", num_slots=(free + (1 << 40)) // (8 << 10))
    assert info.value.errno == errno.ENOSPC
    assert not (tmp_path / "kv").exists()  # not the file, not the directory made for it
    with file_size_limit(64 << 20), pytest.raises(ValueError, match=r"nvme_bytes: .* free"):
        tiered_llm(tmp_path / "kv", nvme_bytes=free + (1 << 40))
    assert not (tmp_path / "kv").exists()


def test_a_failed_creation_removes_the_file_it_created(tmp_path):
    with file_size_limit(1 << 20), pytest.raises(OSError) as info:
        make_store(tmp_path / "kv", num_slots=64)  # 768 KiB of slots: over the limit
    assert info.value.errno == errno.EFBIG
    assert not (tmp_path / "kv").exists()


def test_a_failed_growth_keeps_the_existing_store(tmp_path):
    src, dst = cpu_pool(3), cpu_pool(1)
    fill(src, [1, 2, 3])
    with make_store(tmp_path / "kv", num_slots=4) as store:
        write_all(store, src, [1, 2, 3])
        path, size = store.path, os.path.getsize(store.path)
    with file_size_limit(size + (64 << 10)), pytest.raises(OSError):
        make_store(tmp_path / "kv", num_slots=64)
    assert os.path.getsize(path) == size
    with make_store(tmp_path / "kv", num_slots=4) as store:
        assert store.stats()["restored"] == 3
        job = store.submit_read(BlockRef(2, *_ids(2)), dst[0])
        assert store.wait([job]) == {job: True}


def _ids(h: int) -> tuple[int, list[int]]:
    from tests.test_nvme_store import parent_of, tokens_of

    return parent_of(h), tokens_of(h)


# ------------------------------------------------------------------ 8: user files, links


def test_a_file_that_is_not_a_store_is_never_written(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my thesis, chapter 3\n" * 100)
    with pytest.raises(ValueError, match="not an NVMe block store"):
        make_store(notes)
    assert notes.read_bytes() == b"my thesis, chapter 3\n" * 100
    with pytest.raises(ValueError, match="nvme_path: .*not an NVMe block store"):
        tiered_llm(notes)
    assert notes.read_bytes() == b"my thesis, chapter 3\n" * 100


@pytest.mark.parametrize("where", ["nvme_path", "store file in the directory"])
def test_symbolic_links_are_not_followed(tmp_path, where):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"keep me" * 1000)
    if where == "nvme_path":
        link = tmp_path / "kv"
    else:
        (tmp_path / "kv").mkdir()
        link = tmp_path / "kv" / STORE_FILE_NAME
    link.symlink_to(notes)
    with pytest.raises(ValueError, match="symbolic link"):
        make_store(tmp_path / "kv")
    assert notes.read_bytes() == b"keep me" * 1000 and link.is_symlink()


def test_an_empty_file_and_a_directory_link_are_fine(tmp_path):
    (tmp_path / "empty").touch()
    with make_store(tmp_path / "empty") as store:
        assert store.path == str(tmp_path / "empty")
    (tmp_path / "real").mkdir()
    (tmp_path / "dir-link").symlink_to(tmp_path / "real", target_is_directory=True)
    with make_store(tmp_path / "dir-link"):
        assert (tmp_path / "real" / STORE_FILE_NAME).exists()


# ------------------------------------------------------------------ 10: corruption at start-up


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def _written_store(tmp_path) -> tuple[str, object]:
    src = cpu_pool(6)
    fill(src, range(1, 7))
    with make_store(tmp_path / "kv") as store:
        write_all(store, src, range(1, 7))
        return store.path, store.geometry


@pytest.mark.parametrize("damage", ["headers", "superblock", "zeroed", "garbage"])
def test_corruption_found_at_start_up_is_logged_once_and_counted(tmp_path, damage, caplog):
    path, geometry = _written_store(tmp_path)
    size = os.path.getsize(path)
    if damage == "headers":
        for slot in range(6):
            _flip(path, geometry.slot_offset(slot) + 30)
    elif damage == "superblock":
        _flip(path, 40)
    else:
        with open(path, "r+b") as f:
            f.write(bytes(size) if damage == "zeroed" else os.urandom(size))
    with caplog.at_level(logging.WARNING, logger="tieredkv"):
        store = make_store(tmp_path / "kv")
    stats = store.stats()
    store.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert stats["restored"] == 0
    if damage == "headers":
        assert (stats["scan_discarded"], stats["reformatted"]) == (6, 0)
    else:
        assert (stats["scan_discarded"], stats["reformatted"]) == (0, 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tieredkv"), make_store(tmp_path / "kv") as store:
        assert (store.stats()["scan_discarded"], store.stats()["reformatted"]) == (0 if damage != "headers" else 6, 0)
    assert damage == "headers" or not caplog.records  # a formatted store opens quietly


def test_a_clean_restart_logs_nothing_and_counts_what_it_restored(tmp_path, caplog):
    _written_store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tieredkv"), make_store(tmp_path / "kv") as store:
        stats = store.stats()
    assert (stats["restored"], stats["scan_discarded"], stats["reformatted"]) == (6, 0, 0)
    assert not caplog.records


def test_the_engine_reports_what_the_store_found_at_start_up(tmp_path):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with tiered_llm(tmp_path / "kv") as llm:
        llm.generate(prompts, params, use_tqdm=False)
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
    # (closing may finish a few more writes: count what the new engine found, all of it restored)
    with tiered_llm(tmp_path / "kv") as llm:
        stats = llm.stats()
    restored = stats["nvme_slots_used"]
    assert restored > 0
    assert (stats["nvme_restored"], stats["nvme_scan_discarded"], stats["nvme_reformatted"]) == (restored, 0, 0)


def test_another_models_blocks_of_another_block_size_are_skipped_not_counted_as_damage(tmp_path, caplog):
    """bfloat16 blocks of 8 tokens and float32 blocks of 4 have the same size: the store file's
    layout fits both, and the second engine finds the first one's slots, which hold more tokens
    than its blocks. They are another model's, not damage."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with tiered_llm(tmp_path / "kv", block_size=8, dtype="bfloat16") as llm:
        llm.generate(prompts, params, use_tqdm=False)
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
    with caplog.at_level(logging.WARNING, logger="tieredkv"), tiered_llm(tmp_path / "kv") as llm:
        stats = llm.stats()
    assert (stats["nvme_restored"], stats["nvme_scan_discarded"], stats["nvme_reformatted"]) == (0, 0, 0)
    assert not caplog.records


# ------------------------------------------------------------------ 11: a missing path


def test_a_missing_path_becomes_a_directory_holding_the_store(tmp_path):
    with make_store(tmp_path / "a" / "b") as store:
        assert (tmp_path / "a" / "b").is_dir()
        assert store.path == str(tmp_path / "a" / "b" / STORE_FILE_NAME)
    with make_store(tmp_path / "a" / "b") as store:  # and is found there again
        assert store.path == str(tmp_path / "a" / "b" / STORE_FILE_NAME)


def test_the_engine_makes_the_readme_directory(tmp_path):
    with tiered_llm(tmp_path / "results" / "demo" / "nvme"):
        pass
    assert (tmp_path / "results" / "demo" / "nvme" / STORE_FILE_NAME).is_file()


# ------------------------------------------------------------------ 9: calibration


def _calibrated_llm(tmp_path, monkeypatch) -> LLM:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return LLM(model="tiny-llama", block_size=4, num_gpu_blocks=30, cpu_cache_bytes=24 * TINY_BLOCK_BYTES,
               nvme_path=str(tmp_path / "kv"), nvme_bytes="1MiB", io_backend="sync", preemption="auto")


def test_calibration_that_cannot_write_beside_the_store_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    from tieredkv import calibrate

    with file_size_limit(16 << 20), caplog.at_level(logging.WARNING, logger="tieredkv"):
        llm = _calibrated_llm(tmp_path, monkeypatch)
    cost = llm.scheduler.policy.cost
    llm.close()
    assert cost.disk_read_bytes_per_s == calibrate.DEFAULT_DISK_READ_BYTES_PER_S
    assert "disk_read_bytes_per_s" in caplog.text
    assert not os.path.exists(tmp_path / "kv" / ".tieredkv-calibration")
    cached = json.loads(calibrate.cache_file().read_text())  # the copies and prefill, measured
    assert not [entry for entry in cached if "/disk:" in entry]  # a guess is not cached: the next start measures


def test_calibration_with_little_free_space_does_not_write(tmp_path, monkeypatch, caplog):
    # a disk with less than the probe's 64 MiB free cannot be had here without filling a real one
    from tieredkv import calibrate

    real = shutil.disk_usage
    monkeypatch.setattr(
        calibrate.shutil, "disk_usage", lambda p: real(p)._replace(free=SUPERBLOCK_BYTES * 1000)
    )
    with caplog.at_level(logging.WARNING, logger="tieredkv"):
        llm = _calibrated_llm(tmp_path, monkeypatch)
    cost = llm.scheduler.policy.cost
    llm.close()
    assert cost.disk_read_bytes_per_s == calibrate.DEFAULT_DISK_READ_BYTES_PER_S
    assert "free" in caplog.text


# ------------------------------------------------------------------ bugs are not disk faults


class BuggyBackend(SyncBackend):
    """Hands back a completion the store cannot read (a bug in a backend, not a disk fault)."""

    def reap(self, timeout: float | None) -> list[IOCompletion]:
        return [IOCompletion(c.tag, None) for c in super().reap(timeout)]  # type: ignore[arg-type]


@pytest.mark.allow_internal_errors
def test_a_bug_while_checking_a_job_is_counted_apart_and_logged_as_an_error(tmp_path, caplog):
    src = cpu_pool(1)
    fill(src, [7])
    store = make_store(tmp_path / "kv", backend=BuggyBackend(2))
    with caplog.at_level(logging.ERROR, logger="tieredkv"), store:
        job = store.submit_write(BlockRef(7, *_ids(7)), src[0])
        assert store.wait([job]) == {job: False}  # the job fails; nobody waits forever
        stats = store.stats()
    assert (stats["internal_errors"], stats["io_errors"], stats["writes"]) == (1, 0, 0)
    assert any(r.levelno == logging.ERROR and "internal error" in r.getMessage() for r in caplog.records)


def test_the_disk_probe_reads_through_the_store_backend_at_its_queue_depth(tmp_path):
    from tieredkv import calibrate

    rate = calibrate.measure_disk_read(str(tmp_path), num_bytes=8 << 20, read_bytes=10_000, queue_depth=8)
    assert rate is not None and rate > 0
    assert os.listdir(tmp_path) == []  # the probe file is gone
