"""The interface between the NVMe store and its I/O backends (`io_backends.py`): vectored
positional reads and writes, many in flight::

    backend.submit([IORequest(tag, "write", fd, offset, (header, payload)), ...])  # never waits for I/O
    backend.reap(timeout) -> [IOCompletion(tag, result), ...]  # result: bytes moved, or -errno
    backend.close()                                            # after all completions were reaped

`submit` may raise OSError (none of the requests of that call is in flight then); every
request that was submitted completes exactly once through `reap`, and the caller leaves its
buffers alone until then. Several threads may submit; one thread reaps.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

IOOp = Literal["read", "write"]

# the errors of a disk or a file that is full: a file-size or quota limit fills it as a full
# disk does (the stats count them as `enospc`, the rest of the OS errors as `io_errors`)
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def fault_of(err: int) -> str:
    """The stats counter of an I/O that failed with errno `err`."""
    return "enospc" if err in FULL_DISK_ERRNOS else "io_errors"


@dataclass(frozen=True)
class IORequest:
    """One vectored read or write of `buffers`, back to back, at `offset` of `fd`."""

    tag: int
    op: IOOp
    fd: int
    offset: int
    buffers: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


@dataclass(frozen=True)
class IOCompletion:
    """The outcome of the request with `tag`: bytes transferred (>= 0) or a negative errno."""

    tag: int
    result: int


class BlockIO(ABC):
    """The interface the store calls (see the module docstring)."""

    name: str

    @abstractmethod
    def submit(self, requests: Sequence[IORequest]) -> None:
        """Start the requests; raises OSError if they could not be started."""

    @abstractmethod
    def reap(self, timeout: float | None) -> list[IOCompletion]:
        """Finished requests; waits up to `timeout` seconds (None: forever) for the first one."""

    @abstractmethod
    def close(self) -> None:
        """Release threads and kernel resources."""
