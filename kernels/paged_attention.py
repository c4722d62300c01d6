"""Varlen paged attention over the block-table KV cache: prefill, chunked prefill, decode.

Operations: `paged_attention` (Triton; one entry point) and `paged_attention_ref` (plain torch,
any device and dtype, float32 math).

A batch packs the new query rows of B sequences; their K/V are already in the cache:

    query rows   | seq 0: q_len_0 rows | seq 1: q_len_1 rows | ...      cu_seqlens_q[b] = start
    seq b keys   [0 ............ context_lens[b])   (cached prefix + the new tokens)
    row i of b   sits at p = context_lens[b] - q_len_b + i, attends to keys j <= p
                 (and j > p - sliding_window when a window is set)
    key j of b   cache row (block_tables[b, j // block_size], j % block_size)

`paged_attention` picks kernels from the shapes alone (no host-device sync): when there are at
most as many query rows as sequences (a decode batch) `paged_attention_decode`'s split-K kernel
takes every row; else `paged_attention_prefill`'s tiled kernel takes the sequences with several
rows and the split-K kernel those with one (each reads q_len on the device and skips the others).
Both kernels are correct for any batch on their own.
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_head_dim,
    check_same_device,
    check_shape,
    check_tensor,
)
from .paged_attention_decode import decode_attention
from .paged_attention_prefill import prefill_attention


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """Shape, dtype and device checks shared by the kernel wrapper and the reference."""
    check_tensor("query", query, ndim=3)
    check_tensor("k_cache", k_cache, ndim=4)
    check_shape("v_cache", v_cache, k_cache.shape)
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), ndim=1)
    num_heads, head_dim = query.shape[1:]
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache head_dim {k_cache.shape[3]} does not match query head_dim {head_dim}"
        )
    if kv_heads == 0 or num_heads % kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads, not a multiple of the cache's {kv_heads} kv heads"
        )
    num_seqs = block_tables.shape[0]
    check_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    check_shape("context_lens", context_lens, (num_seqs,))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}; expected query's {query.dtype}")
    if sliding_window is not None and not (
        isinstance(sliding_window, int) and sliding_window >= 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    check_same_device(
        {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
         "cu_seqlens_q": cu_seqlens_q, "context_lens": context_lens}
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed query rows over their sequences' paged K/V.

    query: [T, num_heads, head_dim] (fp16/bf16/fp32, last dim contiguous).
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], contiguous, query's dtype;
    num_heads % kv_heads == 0 (query head h reads kv head h // (num_heads // kv_heads));
    head_dim a power of two >= 16.
    block_tables: [B, max_blocks] int32; cu_seqlens_q: [B + 1] int32 with cu_seqlens_q[0] == 0
    and cu_seqlens_q[B] == T; context_lens: [B] int32, context_lens[b] >= q_len_b.
    Values are not checked (that would sync); the reference checks them.
    Returns [T, num_heads, head_dim] in query's dtype; softmax in float32.
    """
    check_tensor("query", query, dtypes=FLOAT_DTYPES)
    _check_attention_args(
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sliding_window
    )
    check_head_dim(query.shape[2])
    if query.stride(2) != 1:
        raise ValueError(f"query needs a contiguous last dim, got strides {query.stride()}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)):
        check_tensor(name, t, contiguous=True)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    args = (query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, scale,
            sliding_window)
    if query.shape[0] <= block_tables.shape[0]:
        decode_attention(*args)
    else:
        # Mixed batch: each kernel reads q_len on the device and takes its own sequences.
        prefill_attention(*args, skip_single_row_seqs=True)
        decode_attention(*args, single_row_seqs=True)
    return out


def _check_values(
    query: torch.Tensor, block_size: int, max_blocks: int, starts: list[int], ctxs: list[int]
) -> None:
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at T={query.shape[0]}, got {starts}")
    for b, ctx in enumerate(ctxs):
        q_len = starts[b + 1] - starts[b]
        if q_len < 0:
            raise ValueError(f"cu_seqlens_q must not decrease, got {starts}")
        if ctx < q_len:
            raise ValueError(f"sequence {b}: context_lens {ctx} < its {q_len} query rows")
        if math.ceil(ctx / block_size) > max_blocks:
            raise ValueError(
                f"sequence {b}: context {ctx} needs more than block_tables' {max_blocks} blocks"
            )


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_attention` (any device, dtype and head_dim; float32 math).

    Loops over sequences; within one, gathers its blocks and runs dense masked attention.
    """
    _check_attention_args(
        query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sliding_window
    )
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    starts, ctxs = cu_seqlens_q.tolist(), context_lens.tolist()
    _check_values(query, block_size, block_tables.shape[1], starts, ctxs)
    out = torch.zeros_like(query)
    tables = block_tables.to(device=k_cache.device, dtype=torch.int64)
    for b, ctx in enumerate(ctxs):
        start, end = starts[b], starts[b + 1]
        if start == end:
            continue
        ids = tables[b, : math.ceil(ctx / block_size)]
        k = k_cache[ids].reshape(-1, kv_heads, head_dim)[:ctx].float()
        v = v_cache[ids].reshape(-1, kv_heads, head_dim)[:ctx].float()
        q = query[start:end].float().reshape(end - start, kv_heads, -1, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
        pos = torch.arange(ctx - (end - start), ctx, device=query.device)[:, None]
        key = torch.arange(ctx, device=query.device)[None, :]
        allowed = key <= pos
        if sliding_window is not None:
            allowed &= key > pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(end - start, num_heads, head_dim)
        out[start:end] = o.to(query.dtype)
    return out
