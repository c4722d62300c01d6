"""The CPU tier: one host tensor of KV blocks, block-major, pinned when CUDA is present.

    data[cpu_block] = [layers, 2, block_size, kv_heads, head_dim]   (one contiguous run of bytes)
    blocks[cpu_block]: its bytes (flat uint8, as the lower tier's stores take a block), made at
                       start (`BlockViews`)

Plain storage: which block holds what is the CPU offload's bookkeeping (`cache/offload.py`).
"""

from __future__ import annotations

import logging
import weakref

import torch

from tieredkv.tiers.nvme.slot_format import aligned_empty

logger = logging.getLogger(__name__)


class BlockViews:
    """`views[i]` is the bytes of `data[i]` (flat uint8), all made at once when the tier is
    (one torch operator for every block: ~0.1 s for 32k blocks). Indexing or viewing a tensor
    is a torch operator: it gives up the GIL and waits to take it back, up to a switch interval
    while the I/O threads run Python; the lower tier's reads and writes name their blocks by
    index, many a step, and a store takes them as they are (`check_block`)."""

    def __init__(self, data: torch.Tensor) -> None:
        self._views = data.reshape(data.shape[0], -1).view(torch.uint8).unbind(0)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._views[index]

    def __len__(self) -> int:
        return len(self._views)


class CPUTier:
    """`num_blocks` host blocks of shape `block_shape`."""

    def __init__(
        self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
        memory: torch.Tensor | None = None,
    ) -> None:
        """`memory`: zeroed uint8 bytes to hold the blocks (e.g. shared with another process);
        allocated here when None."""
        shape = (num_blocks, *block_shape)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if memory is None:
            # page-aligned, so that NVMe I/O goes straight to and from the blocks (O_DIRECT)
            memory = aligned_empty(nbytes).zero_()
        assert memory.numel() == nbytes and memory.dtype == torch.uint8, "memory holds exactly the blocks' bytes"
        self.data = memory.view(dtype).view(shape)
        self.blocks = BlockViews(self.data)
        self.pinned = pin and _pin(self.data)
        self._unpin: weakref.finalize | None = None
        if self.pinned:
            # a tier dropped without `close` unpins its memory too: pages freed while registered
            # stay registered, and the next tier the allocator puts there could not be pinned
            self._unpin = weakref.finalize(self, _unpin, self.data.data_ptr())
            self._unpin.atexit = False  # at exit the process's pages go anyway

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self.pinned = False


def _pin(tensor: torch.Tensor) -> bool:
    """Page-lock `tensor` in place; False (with a warning) if it cannot be, and the tier works
    unpinned. `cudaHostRegister` pins exactly its bytes, where torch's pinned allocator would
    round a large request up to a power of two."""
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(err) != 0:
        _take_cuda_error()
        logger.warning("could not pin the %d-byte CPU tier (cudaError %s): host copies will be slow", nbytes, err)
        return False
    return True


def _unpin(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _take_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error for CUDA's next kernel launch to report (torch
    binds no `cudaGetLastError`): one launch here takes it, so that the engine's first does not
    fail with it."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass
