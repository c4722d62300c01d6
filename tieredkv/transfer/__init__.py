"""Block moves between the GPU tier and the CPU tier: the two-phase engine (`engine.py`, a
synchronous copy on CPU) and its CUDA version (`cuda.py`: side streams, staging, events)."""

from tieredkv.transfer.engine import (
    TransferEngine,
    TransferError,
    TransferJob,
    make_transfer_engine,
)

__all__ = ["TransferEngine", "TransferError", "TransferJob", "make_transfer_engine"]
