"""What the GPU did, as the profiler (CUPTI) recorded it: when each copy and kernel ran, and the
figures made of those intervals. Events timed on the compute stream say when work could start
and when all of it was done; they cannot say whether two jobs ran side by side. This can.

Operations:
- `trace(fn) -> list[Op]`: run `fn` under `torch.profiler` and return its device operations.
- `span_s(ops)`: from the first start to the last end; `busy_s(ops)`: time covered by any of
  them; `overlap_s(a, b)`: time when some op of `a` and some op of `b` ran at once.
- `TwoWay.of(ops)`: the D2H and H2D copies of a two-way transfer: each direction's copy time,
  how much of the shorter one ran beside the other (1.0: all of it, as two independent copy
  engines allow; near 0: the directions took turns), and how long the later direction started
  after the earlier one.

    0 ms        10          20          30          40
    D2H  ████████████████████████████████
    H2D              ███████████████████████████████    concurrency = overlap / shorter = 0.5
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

OpKind = Literal["d2h", "h2d", "kernel", "other"]
# a job's block ids go up in one copy of a few KiB (microseconds); its data moves in runs of
# whole KV blocks, each at least a block (2 MiB of Llama-8B KV: ~40 us at 55 GB/s)
MIN_DATA_COPY_S = 20e-6


@dataclass(frozen=True)
class Op:
    """One device operation: a copy or a kernel (seconds on the profiler's clock)."""

    kind: OpKind
    name: str
    start_s: float
    end_s: float
    stream: int | None = None


def op_kind(name: str) -> OpKind:
    """`Memcpy DtoH (Device -> Pinned)` is d2h, `Memcpy HtoD ...` h2d, other copies and sets
    other, anything else a kernel."""
    if "DtoH" in name:
        return "d2h"
    if "HtoD" in name:
        return "h2d"
    if name.startswith(("Memcpy", "Memset")):
        return "other"
    return "kernel"


def trace(fn: Callable[[], object]) -> list[Op]:
    """Run `fn` (and wait for the GPU) under the profiler; its device operations in start order."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = [Op(op_kind(e.name), e.name, e.time_range.start / 1e6, e.time_range.end / 1e6,
              getattr(e, "device_resource_id", None))
           for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sorted(ops, key=lambda op: op.start_s)


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intervals(ops: Iterable[Op]) -> list[tuple[float, float]]:
    return [(op.start_s, op.end_s) for op in ops]


def span_s(ops: list[Op]) -> float:
    """Seconds from the first op's start to the last op's end (0 for none)."""
    return max(op.end_s for op in ops) - min(op.start_s for op in ops) if ops else 0.0


def busy_s(ops: Iterable[Op]) -> float:
    """Seconds during which at least one of `ops` ran."""
    return sum(end - start for start, end in _merged(_intervals(ops)))


def overlap_s(a: Iterable[Op], b: Iterable[Op]) -> float:
    """Seconds during which an op of `a` and an op of `b` ran at the same time."""
    x, y = _merged(_intervals(a)), _merged(_intervals(b))
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class TwoWay:
    """The copies of a two-way transfer (seconds)."""

    d2h_s: float  # time some D2H copy ran
    h2d_s: float
    both_s: float  # time both directions ran at once
    later_start_s: float  # how long after the first copy of one direction the other began

    @classmethod
    def of(cls, ops: list[Op], min_copy_s: float = MIN_DATA_COPY_S) -> TwoWay:
        """From a trace; copies shorter than `min_copy_s` are not data (the block-id uploads)."""
        d2h = [op for op in ops if op.kind == "d2h" and op.end_s - op.start_s >= min_copy_s]
        h2d = [op for op in ops if op.kind == "h2d" and op.end_s - op.start_s >= min_copy_s]
        if not d2h or not h2d:
            raise ValueError(f"a two-way transfer needs copies both ways; the trace has {len(d2h)} D2H "
                             f"and {len(h2d)} H2D")
        starts = (min(op.start_s for op in d2h), min(op.start_s for op in h2d))
        return cls(busy_s(d2h), busy_s(h2d), overlap_s(d2h, h2d), max(starts) - min(starts))

    @property
    def concurrency(self) -> float:
        """The share of the shorter direction's copy time that ran beside the other's."""
        return self.both_s / min(self.d2h_s, self.h2d_s)
