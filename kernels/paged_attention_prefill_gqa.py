"""Prefill-shaped paged attention with the query heads of one KV head packed into one tile (GQA).

Operation: `prefill_attention_gqa` (launcher; `paged_attention` validates the arguments first).
Same contract as `paged_attention_prefill.prefill_attention`; the plain-torch reference is
`paged_attention.paged_attention_ref`.

Grid (query tile, kv head). A program owns BLOCK_Q consecutive rows of one sequence and all
GROUP query heads that read its kv head, so every K/V tile it loads feeds GROUP heads (the
one-head kernel loads each tile GROUP times, once per head). The tile's rows are row-major in
(query row, head), padded to GROUP_PAD heads (a power of two):

    tile row r = i * GROUP_PAD + g      query row row0 + i, query head kv_head * GROUP + g
    r:    0    1    2    3  |  4    5    6    7  | ...         (GROUP = GROUP_PAD = 4)
    i,g:  0,0  0,1  0,2  0,3 | 1,0  1,1  1,2  1,3 | ...

Keys before the tile's first position are visible to every row (unmasked tiles); only the
diagonal band, BLOCK_Q positions wide, is masked. With a sliding window every tile is masked.
Programs run longest first: a sequence's last tiles, which attend the most keys, get the lowest
block ids, so the GPU does not end on a tail of long programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_common import LOG2_E, attend_tiles, find_seq
from ._checks import check_launchable


# per-step sizes are not specialized on: one compiled kernel serves every batch
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _prefill_gqa_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    table_ptr, cu_q_ptr, ctx_ptr,
    num_seqs, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SKIP_SINGLE_ROW_SEQS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # longest first (see module doc)
    kv_head = tl.program_id(1)
    b = find_seq(cu_q_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    row0 = (pid - q_start // BLOCK_Q - b) * BLOCK_Q
    skip = row0 >= q_len
    if SKIP_SINGLE_ROW_SEQS:
        skip = skip | (q_len == 1)
    if skip:
        return
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    rows = row0 + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (rows < q_len) & (g < GROUP)
    ctx = tl.load(ctx_ptr + b)
    first_pos = ctx - q_len + row0
    pos = ctx - q_len + rows
    dims = tl.arange(0, HEAD_DIM)
    q_offset = (q_start + rows).to(tl.int64)[:, None] * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh
    q = tl.load(q_ptr + q_offset + dims[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    table = table_ptr + b * stride_bt
    head_offset = kv_head * stride_kh
    end = tl.minimum(first_pos + BLOCK_Q, ctx)
    if USE_WINDOW:
        start = tl.maximum(first_pos + 1 - window, 0)
        m, denom, acc = attend_tiles(
            q, m, denom, acc, k_ptr, v_ptr, table, head_offset, pos, start, end, window,
            scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, True, PRECISION,
        )
    else:
        full_end = first_pos // BLOCK_N * BLOCK_N
        m, denom, acc = attend_tiles(
            q, m, denom, acc, k_ptr, v_ptr, table, head_offset, pos, 0, full_end, window,
            scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False,
            PRECISION, WARP_SPECIALIZE,
        )
        m, denom, acc = attend_tiles(
            q, m, denom, acc, k_ptr, v_ptr, table, head_offset, pos, full_end, end, window,
            scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, PRECISION,
        )
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_offset = (q_start + rows).to(tl.int64)[:, None] * stride_ot + (kv_head * GROUP + g)[:, None] * stride_oh
    tl.store(out_ptr + out_offset + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def default_config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Launch options: BLOCK_M tile rows (query rows x padded group), BLOCK_N keys per tile,
    num_warps, num_stages. Smaller tiles where float32 or a wide head would overflow shared
    memory. `benchmarks/bench_kernels.py` sweeps the alternatives on the device."""
    if dtype == torch.float32 or head_dim >= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def prefill_attention_gqa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    skip_single_row_seqs: bool = False,
    config: dict[str, int] | None = None,
) -> None:
    """Write attention of query rows into `out` (validated arguments, see module doc).

    skip_single_row_seqs: leave sequences with q_len == 1 to the decode kernel.
    config: BLOCK_M (tile rows; BLOCK_M // GROUP_PAD query rows, at least one), BLOCK_N,
    num_warps, num_stages and optionally WARP_SPECIALIZE (0/1); None: `default_config`.
    """
    check_launchable("paged_attention", query.device, _prefill_gqa_kernel)
    num_rows, num_heads, head_dim = query.shape
    if num_rows == 0:
        return
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    launch = dict(config or default_config(query.dtype, head_dim))
    block_q = max(1, launch.pop("BLOCK_M") // group_pad)
    warp_specialize = bool(launch.pop("WARP_SPECIALIZE", 0))
    grid = (num_rows // block_q + num_seqs, kv_heads)
    _prefill_gqa_kernel[grid](
        query, k_cache, v_cache, out,
        block_tables, cu_seqlens_q, context_lens,
        num_seqs, scale * LOG2_E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, USE_WINDOW=sliding_window is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SKIP_SINGLE_ROW_SEQS=skip_single_row_seqs, WARP_SPECIALIZE=warp_specialize, **launch,
    )
