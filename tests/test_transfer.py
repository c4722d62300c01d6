"""The transfer engine's CPU twin: exact copies, DMA runs, failures that start nothing."""

from __future__ import annotations

import pytest
import torch

from tieredkv.transfer.engine import TransferEngine, TransferError, TransferJob, consecutive_runs


def test_round_trip_of_scattered_blocks_is_bit_identical():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((3, 2, 20, 4, 2, 8), generator=gen).to(torch.bfloat16)
    original = kv.clone()
    cpu = torch.zeros((16, 3, 2, 4, 2, 8), dtype=torch.bfloat16)
    engine = TransferEngine(kv, cpu)
    gpu_ids = (17, 2, 9, 3, 11)
    cpu_ids = (5, 6, 7, 0, 12)
    out = engine.submit(TransferJob("d2h", gpu_ids, cpu_ids))
    kv.zero_()
    back = engine.submit(TransferJob("h2d", (1, 4, 19, 8, 0), cpu_ids))
    assert sorted(engine.poll()) == [out, back]
    for src, dst in zip(gpu_ids, (1, 4, 19, 8, 0), strict=True):
        assert torch.equal(kv[:, :, dst], original[:, :, src])
    assert engine.bytes_moved == {"d2h": 5 * cpu[0].numel() * 2, "h2d": 5 * cpu[0].numel() * 2}
    assert engine.jobs_started == {"d2h": 1, "h2d": 1}
    assert engine.submit_s["d2h"] > 0 and engine.submit_s["h2d"] > 0  # the CPU twin copies inside submit


def test_consecutive_runs():
    assert consecutive_runs((4, 5, 6, 9, 2, 3)) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert consecutive_runs(()) == []


def test_a_copy_that_fails_to_start_raises_transfer_error():
    # a CPU tier whose blocks have another shape: the copy cannot run
    engine = TransferEngine(torch.zeros((1, 2, 4, 2, 1, 2)), torch.zeros((2, 1, 2, 3, 1, 2)))
    with pytest.raises(TransferError, match="d2h transfer of 1 blocks failed: shape mismatch"):
        engine.submit(TransferJob("d2h", (0,), (1,)))
    assert engine.num_failures == 1 and engine.bytes_moved["d2h"] == 0
    assert engine.jobs_started["d2h"] == 0 and engine.submit_s["d2h"] == 0.0
