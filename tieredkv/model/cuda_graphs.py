"""CUDA graphs of forward passes.

A step launches hundreds of small kernels; unless it carries thousands of tokens, the host
cannot launch them as fast as the GPU runs them. `StepGraphs` records the forward pass once
per bucket of (T tokens, B sequences) over static input buffers:

- decode buckets, T == B: one new token for each sequence;
- mixed buckets, B < T <= `max_mixed_tokens`: decodes beside prefill chunks (a returning
  request's new message, the tail of a chunked prefill).

A step copies its inputs into the buffers of the smallest bucket that holds it and replays
that bucket's graph. The attention kernels read the sequence boundaries from the device, so
one graph serves every split of its T tokens among its B sequences.

Padding: the sequences past the step's B hold one token each, the last one all the tokens
past the step's T; they write no KV (slot -1), attend only to their own rows' keys through
whatever their block-table rows hold, and their logits are dropped.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import numpy as np
import torch

from tieredkv.model import attention

if TYPE_CHECKING:
    from tieredkv.model.runner import ModelRunner, StepInputs

MIXED_TOKEN_BUCKETS = (128, 256, 512, 1024)
MAX_MIXED_TOKENS = MIXED_TOKEN_BUCKETS[-1]  # larger steps keep the GPU busier than their launches take


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to `max_batch` (and `max_batch` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


def mixed_buckets(max_batch: int, max_tokens: int) -> list[tuple[int, int]]:
    """(T, B) buckets of mixed steps: T up to `max_tokens`, B a power of two (or `max_batch`)
    below T."""
    seqs = sorted({*(1 << i for i in range(max_batch.bit_length())), max_batch})
    return [(t, b) for t in MIXED_TOKEN_BUCKETS if t <= max_tokens for b in seqs if b < t]


def _pads(tokens: int, seqs: int) -> bool:
    """Whether `seqs` padding sequences can hold `tokens` padding tokens (one or more each)."""
    return seqs >= 0 and tokens >= seqs and (seqs > 0 or tokens == 0)


class StepGraphs:
    """One captured forward pass per (T, B) bucket, all sharing one memory pool."""

    def __init__(self, runner: ModelRunner, max_batch: int, table_width: int, max_mixed_tokens: int) -> None:
        self.runner = runner
        self.table_width = table_width
        # a padding sequence's keys must fit in its block-table row
        max_mixed_tokens = min(max_mixed_tokens, table_width * runner.block_size)
        self.decode = batch_buckets(max_batch)
        self.mixed = mixed_buckets(max_batch, max_mixed_tokens)
        keys = [(b, b) for b in self.decode] + self.mixed
        max_t, max_b = max(t for t, _ in keys), max(b for _, b in keys)
        device = runner.device
        self.tokens = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_t, dtype=torch.int64, device=device)
        self.slots = torch.full((max_t,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.zeros(max_b + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_b, table_width), dtype=torch.int32, device=device)
        self.rows = torch.zeros(max_b, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        gc.collect()  # what earlier engines left (their graphs too) goes before, not during, a capture
        pool = None
        for key in sorted(keys, reverse=True):  # largest first: the smaller ones reuse its memory
            self._capture(key, pool)
            pool = self.graphs[key].pool()

    def _forward(self, t: int, b: int) -> torch.Tensor:
        ctx = attention.ForwardContext(
            self.runner.kv_cache, self.slots[:t], self.block_tables[:b], self.cu_seqlens[: b + 1],
            self.context_lens[:b],
        )
        return self.runner.forward(self.tokens[:t], self.positions[:t], ctx, self.rows[:b])

    def _capture(self, key: tuple[int, int], pool: tuple | None) -> None:
        t, b = key
        self._pad(0, 0, t, b)  # all padding: valid metadata for the warm-up and the capture
        self._forward(t, b)  # warm-up: compiles kernels, settles allocations
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        # No collection during the capture: it could free another engine's graphs (or tensors)
        # in the middle of it. Other threads' CUDA calls (transfers, the store) do not
        # invalidate it (thread-local mode).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.logits[key] = self._forward(t, b)
        finally:
            if collecting:
                gc.enable()
        self.graphs[key] = graph

    def release(self) -> None:
        """Free every graph and its memory pool now (after the work queued on them)."""
        torch.cuda.synchronize(self.runner.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()

    def bucket(self, step: StepInputs) -> tuple[int, int] | None:
        """The smallest bucket that holds the step, or None (run it eagerly)."""
        num_tokens, num_seqs = len(step.tokens), len(step.context_lens)
        if step.block_tables.shape[1] > self.table_width:
            return None
        if step.is_decode:
            return next(((b, b) for b in self.decode if b >= num_seqs), None)
        return next(((t, b) for t, b in self.mixed if _pads(t - num_tokens, b - num_seqs)), None)

    def run(self, step: StepInputs, key: tuple[int, int]) -> torch.Tensor:
        t, b = key
        num_tokens, num_seqs = len(step.tokens), len(step.context_lens)
        for buf, values in ((self.tokens, step.tokens), (self.positions, step.positions), (self.slots, step.slots),
                            (self.cu_seqlens, step.cu_seqlens), (self.context_lens, step.context_lens)):
            buf[: len(values)].copy_(torch.from_numpy(values), non_blocking=True)
        width = step.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(torch.from_numpy(step.block_tables), non_blocking=True)
        rows = np.zeros(b, dtype=np.int64)  # padding rows read row 0: any row in range will do
        rows[: len(step.logits_indices)] = step.logits_indices
        self.rows[:b].copy_(torch.from_numpy(rows), non_blocking=True)
        self._pad(num_tokens, num_seqs, t, b)
        self.graphs[key].replay()
        return self.logits[key][: len(step.logits_indices)].clone()

    def _pad(self, num_tokens: int, num_seqs: int, t: int, b: int) -> None:
        """Fill the buffers past the step's tokens and sequences with padding (see module doc)."""
        self.slots[num_tokens:t].fill_(-1)
        starts = np.arange(num_tokens, num_tokens + b - num_seqs + 1, dtype=np.int32)
        starts[-1] = t
        self.cu_seqlens[num_seqs : b + 1].copy_(torch.from_numpy(starts), non_blocking=True)
        self.context_lens[num_seqs:b].copy_(torch.from_numpy(np.diff(starts)), non_blocking=True)
