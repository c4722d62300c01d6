"""CUDA graphs of decode steps.

A decode step (one new token for each of B sequences) launches hundreds of small kernels; at
small batches the host cannot launch them as fast as the GPU runs them. `DecodeGraphs`
records the whole forward pass once per batch-size bucket over static input buffers, and a
step then copies its inputs into those buffers and replays the graph.

Padding rows (bucket > B) write no KV (slot -1) and attend to one key of block 0; their
logits are dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tieredkv.model import attention

if TYPE_CHECKING:
    from tieredkv.model.runner import ModelRunner, StepInputs


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to `max_batch` (and `max_batch` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


class DecodeGraphs:
    """One captured decode forward pass per batch-size bucket, sharing a memory pool."""

    def __init__(self, runner: ModelRunner, max_batch: int, table_width: int) -> None:
        self.runner = runner
        self.buckets = batch_buckets(max_batch)
        self.table_width = table_width
        device = runner.device
        n = self.buckets[-1]
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, table_width), dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self._capture(size, pool)
            pool = self.graphs[size].pool()

    def _forward(self, size: int) -> torch.Tensor:
        ctx = attention.ForwardContext(
            self.runner.kv_cache, self.slots[:size], self.block_tables[:size], self.cu_seqlens[: size + 1],
            self.context_lens[:size],
        )
        return self.runner.forward(self.tokens[:size], self.positions[:size], ctx, self.rows[:size])

    def _capture(self, size: int, pool: tuple | None) -> None:
        self._forward(size)  # warm-up: compiles kernels, settles allocations
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits[size] = self._forward(size)
        self.graphs[size] = graph

    def fits(self, step: StepInputs) -> bool:
        return (
            step.is_decode
            and len(step.context_lens) <= self.buckets[-1]
            and step.block_tables.shape[1] <= self.table_width
        )

    def run(self, step: StepInputs) -> torch.Tensor:
        b = len(step.context_lens)
        size = next(s for s in self.buckets if s >= b)
        for buf, values in ((self.tokens, step.tokens), (self.positions, step.positions),
                            (self.slots, step.slots), (self.context_lens, step.context_lens)):
            buf[:b].copy_(torch.from_numpy(values), non_blocking=True)
        self.slots[b:size].fill_(-1)
        self.context_lens[b:size].fill_(1)
        width = step.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(torch.from_numpy(step.block_tables), non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:b].clone()
