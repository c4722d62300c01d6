"""The CPU tier's pinned memory: a tier unpins what it pinned when closed or when dropped without
closing (pages freed while registered stay registered, and a later tier the allocator puts on
them could not be pinned), and a tier that cannot be pinned works unpinned, taking the failed
call's error so that the next CUDA launch does not fail with it.

On the CPU, `torch.cuda.cudart()` is a recording stand-in with CUDA's answers; the GPU test
below drops real pinned tiers."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from tieredkv.tiers import cpu
from tieredkv.tiers.cpu import CPUTier

ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class Cudart:
    """Registers and unregisters host ranges as the CUDA runtime does: an overlap is refused."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}  # start -> bytes

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        if any(address < start + size and start < address + nbytes for start, size in self.ranges.items()):
            return ALREADY_REGISTERED
        self.ranges[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        return 0 if self.ranges.pop(address, None) is not None else 1


@pytest.fixture
def cudart(monkeypatch) -> Cudart:
    fake = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_a_tier_dropped_without_closing_unpins_its_memory(cudart):
    tier = CPUTier(4, (2, 8), torch.float32, pin=True)
    assert tier.pinned and list(cudart.ranges) == [tier.data.data_ptr()]
    del tier
    gc.collect()
    assert cudart.ranges == {}


def test_a_closed_tier_unpins_once(cudart, monkeypatch):
    tier = CPUTier(4, (2, 8), torch.float32, pin=True)
    tier_address = tier.data.data_ptr()
    unregistered = []
    monkeypatch.setattr(cudart, "cudaHostUnregister", lambda address: unregistered.append(address) or 0)
    tier.close()
    tier.close()
    del tier
    gc.collect()
    assert unregistered == [tier_address]


def test_a_tier_that_cannot_be_pinned_works_unpinned_and_takes_the_error(cudart, monkeypatch, caplog):
    taken = []
    monkeypatch.setattr(cpu, "_take_cuda_error", lambda: taken.append(True))
    first = CPUTier(4, (2, 8), torch.float32, pin=True)
    # someone else's registration over the next tier's pages
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda address, nbytes, flags: ALREADY_REGISTERED)
    with caplog.at_level(logging.WARNING, logger="tieredkv.tiers.cpu"):
        second = CPUTier(4, (2, 8), torch.float32, pin=True)
    assert first.pinned and not second.pinned and taken == [True]
    assert "could not pin the 256-byte CPU tier" in caplog.text
    second.data[3].fill_(5.0)  # plain memory: the tier works
    assert bool((second.data[3] == 5.0).all())
    second.close()
    first.close()
    assert cudart.ranges == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tiers_dropped_without_closing_leave_later_tiers_pinnable():
    """Small tiers come from the heap, so a dropped one's pages are handed out again at once."""
    for _ in range(20):
        tier = CPUTier(9, (3, 2, 5, 1, 24), torch.float32, pin=True)
        assert tier.pinned
        del tier
    tier = CPUTier(8, (2, 2, 4, 1, 8), torch.float32, pin=True)
    assert tier.pinned
    assert torch.zeros(1, device="cuda").item() == 0.0  # no error left for the next launch
    tier.close()
