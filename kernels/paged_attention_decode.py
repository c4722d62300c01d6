"""Decode-shaped paged attention (flash-decoding), used by `paged_attention` for decode batches.

Operation: `decode_attention` (launcher; `paged_attention` validates the arguments first).

Grid (query row, kv head, split). A program loads the GROUP query heads that share its kv head
(padded to >= 16 rows for tl.dot), so each K/V byte is read once per kv head. The keys of a row,
[lo, pos], are cut into NUM_SPLITS ranges of whole BLOCK_N tiles, one per program:

    keys  lo ────────────────────────────── pos
          | split 0   | split 1   | split 2 |      each writes (m, denom, acc) partials
                                                   _merge_splits_kernel: out = Σ w·acc / Σ w·denom

Correct for any q_len (each row is handled on its own); fast when rows are few and contexts long.
In a mixed batch it takes only the sequences with one query row (`single_row_seqs`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._attention_common import LOG2_E, attend_tiles, find_seq
from ._checks import check_launchable

_MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 512


# per-step sizes are not specialized on: one compiled kernel serves every batch
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    table_ptr, cu_q_ptr, ctx_ptr,
    num_seqs, num_heads, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SINGLE_ROW_SEQS: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SINGLE_ROW_SEQS:  # one program per sequence; only sequences with q_len == 1 run
        b = pid
        row = 0
    else:  # one program per row (+1 per sequence): sequence b's rows start at cu_q[b] + b
        b = find_seq(cu_q_ptr, num_seqs, pid, 1)
        row = pid - tl.load(cu_q_ptr + b) - b
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    skip = row >= q_len
    if SINGLE_ROW_SEQS:
        skip = q_len != 1
    if skip:
        return
    t = q_start + row
    pos = tl.load(ctx_ptr + b) - q_len + row
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(pos + 1 - window, 0)
    per_split = tl.cdiv(tl.cdiv(pos + 1 - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, pos + 1)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None], other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # The range [start, end) already respects the causal bound and the window.
    m, denom, acc = attend_tiles(
        q, m, denom, acc, k_ptr, v_ptr, table_ptr + b * stride_bt, kv_head * stride_kh,
        tl.zeros([GROUP_PAD], tl.int32) + pos, start, end, window, scale_log2,
        stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, PRECISION,
    )
    if NUM_SPLITS == 1:
        out = acc / denom[:, None]
        out_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        part = (t * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_ml_ptr + part * 2, m, mask=head_ok)
        tl.store(part_ml_ptr + part * 2 + 1, denom, mask=head_ok)
        part_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :]
        tl.store(part_ptrs, acc, mask=head_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, cu_q_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SINGLE_ROW_SEQS: tl.constexpr,
):
    """Program (row t, head h): combine the NUM_SPLITS partial softmax states of (t, h).

    With SINGLE_ROW_SEQS the first axis is the sequence, and only single-row sequences merge.
    """
    t = tl.program_id(0)
    h = tl.program_id(1)
    if SINGLE_ROW_SEQS:
        q_start = tl.load(cu_q_ptr + t)
        if tl.load(cu_q_ptr + t + 1) - q_start != 1:
            return
        t = q_start
    part = (t * num_heads + h) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(part_ml_ptr + part * 2)
    denom = tl.load(part_ml_ptr + part * 2 + 1)
    weight = tl.math.exp2(m - tl.max(m, 0))  # an empty split has m = -inf: weight 0
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(denom * weight, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def _config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Tuned on an H200 (bf16, head_dim 128); halved key tiles where shared memory is short."""
    if dtype == torch.float32 or head_dim >= 256:
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_rows: int, kv_heads: int, max_keys: int, device: torch.device
) -> int:
    """Split keys until the grid fills the GPU twice over, keeping >= 512 keys per split."""
    splits = 1
    while (
        num_rows * kv_heads * splits < 2 * _num_sms(device)
        and max_keys >= 2 * splits * _MIN_KEYS_PER_SPLIT
        and splits < _MAX_SPLITS
    ):
        splits *= 2
    return splits


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    single_row_seqs: bool = False,
    num_splits: int | None = None,
    config: dict[str, int] | None = None,
) -> None:
    """Write attention of query rows into `out` (validated arguments, see module doc).

    single_row_seqs: only the rows of sequences with q_len == 1 (the decodes of a mixed batch;
    the prefill kernel takes the others); else every row.
    num_splits: a power of two, or None to pick one from the shapes.
    config: BLOCK_N, num_warps, num_stages; None uses the tuned default.
    """
    check_launchable("paged_attention", query.device, _decode_kernel)
    num_rows, num_heads, head_dim = query.shape
    if num_rows == 0:
        return
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    if num_splits is None:
        max_keys = block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_keys = min(max_keys, sliding_window)
        rows = num_seqs if single_row_seqs else num_rows
        num_splits = choose_num_splits(rows, kv_heads, max_keys, query.device)
    assert num_splits & (num_splits - 1) == 0, f"num_splits {num_splits} is not a power of two"
    group = num_heads // kv_heads
    part_acc = part_ml = out  # unused when there is one split
    if num_splits > 1:
        part_acc = query.new_empty((num_rows, num_heads, num_splits, head_dim), dtype=torch.float32)
        part_ml = query.new_empty((num_rows, num_heads, num_splits, 2), dtype=torch.float32)
    programs = num_seqs if single_row_seqs else num_rows + num_seqs
    grid = (programs, kv_heads, num_splits)
    _decode_kernel[grid](
        query, k_cache, v_cache, out, part_acc, part_ml,
        block_tables, cu_seqlens_q, context_lens,
        num_seqs, num_heads, scale * LOG2_E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SINGLE_ROW_SEQS=single_row_seqs, **(config or _config(query.dtype, head_dim)),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs if single_row_seqs else num_rows, num_heads)](
            out, part_acc, part_ml, cu_seqlens_q, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, SINGLE_ROW_SEQS=single_row_seqs,
        )
