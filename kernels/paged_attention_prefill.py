"""Prefill-shaped paged attention (tiled, tl.dot), used by `paged_attention` for prefill and
mixed batches.

Operation: `prefill_attention` (launcher; `paged_attention` validates the arguments first).

Grid (query tile, query head). A program owns BLOCK_M consecutive rows of one sequence and walks
the keys in BLOCK_N tiles. Keys before the tile's first position are visible to every row, so
those tiles skip masking; only the diagonal band is masked:

    rows  p0 .. p0+BLOCK_M-1        keys 0 ─────────────── p0 ──────── p0+BLOCK_M
                                         | unmasked tiles  | masked (causal) |

With a sliding window every tile is masked (rows see different lower bounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_common import LOG2_E, attend_tiles, find_seq
from ._checks import check_launchable


# per-step sizes are not specialized on: one compiled kernel serves every batch
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    table_ptr, cu_q_ptr, ctx_ptr,
    num_seqs, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SKIP_SINGLE_ROW_SEQS: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    b = find_seq(cu_q_ptr, num_seqs, pid, BLOCK_M)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    row0 = (pid - q_start // BLOCK_M - b) * BLOCK_M
    skip = row0 >= q_len
    if SKIP_SINGLE_ROW_SEQS:
        skip = skip | (q_len == 1)
    if skip:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    ctx = tl.load(ctx_ptr + b)
    first_pos = ctx - q_len + row0
    pos = first_pos + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None], other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = table_ptr + b * stride_bt
    head_offset = (head // GROUP) * stride_kh
    end = tl.minimum(first_pos + BLOCK_M, ctx)
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
            PRECISION,
        )
        m, denom, acc = attend_tiles(
            q, m, denom, acc, k_ptr, v_ptr, table, head_offset, pos, full_end, end, window,
            scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, PRECISION,
        )
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def default_config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Tile sizes and launch options (tuned on an H200 for bf16, head_dim 128; smaller tiles where
    float32 or a wide head would overflow shared memory)."""
    if dtype == torch.float32 or head_dim >= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def prefill_attention(
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
    config: BLOCK_M, BLOCK_N, num_warps, num_stages; None picks by dtype and head_dim.
    """
    check_launchable("paged_attention", query.device, _prefill_kernel)
    num_rows, num_heads, head_dim = query.shape
    if num_rows == 0:
        return
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    config = config or default_config(query.dtype, head_dim)
    grid = (num_rows // config["BLOCK_M"] + num_seqs, num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out,
        block_tables, cu_seqlens_q, context_lens,
        num_seqs, scale * LOG2_E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SKIP_SINGLE_ROW_SEQS=skip_single_row_seqs, **config,
    )
