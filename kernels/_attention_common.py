"""Triton building blocks shared by the decode and prefill attention kernels.

- `find_seq`: which sequence owns a query tile (binary search over cu_seqlens_q, no host sync);
- `attend_tiles`: online-softmax over a range of key positions read through a block table;
- `attend_pages`: the same over whole unmasked tiles that each lie inside one page, loaded by the
  tensor memory accelerator (TMA) through descriptors of the caches.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def find_seq(cu_q_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Return the sequence b owning query tile `pid` when sequence b's tiles start at
    `cu_q[b] // BLOCK_Q + b` (a strictly increasing number, so a binary search finds it).

        cu_q = [0, 5, 5, 7], BLOCK_Q = 4     seq 0: 5 rows, seq 1: empty, seq 2: 2 rows
        tile starts  0 // 4 + 0 = 0,  5 // 4 + 1 = 2,  5 // 4 + 2 = 3
        tiles        0 1 -> seq 0     2 -> seq 1 (exits early)     3 -> seq 2

    Each sequence gets ceil(q_len / BLOCK_Q) tiles or one more, so T // BLOCK_Q + B programs
    cover every batch.
    """
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= pid, mid, lo)
        hi = tl.where(start <= pid, hi, mid)
    return lo


@triton.jit
def _online_softmax(s, m, denom, scale_log2):
    """One tile's step of the online softmax: scores `s` (raw; -inf where a key is hidden) into
    the running max and sum (m, denom). Returns (m, denom, p, alpha): the tile's probabilities
    and the factor that rescales what was accumulated before it.

    Scores are scaled where they are used (scale_log2 > 0, so the max commutes with it): one fused
    multiply-add per score instead of a multiply and a subtract. A row that has seen no visible
    key yet keeps m = -inf; it shifts by 0 to avoid inf - inf.
    """
    m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_safe)
    p = tl.math.exp2(s * scale_log2 - m_safe[:, None])
    return m_new, denom * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def attend_tiles(
    q,
    m,
    denom,
    acc,
    k_ptr,
    v_ptr,
    table_ptr,
    head_offset,
    pos,
    start,
    end,
    window,
    scale_log2,
    stride_kb,
    stride_kt,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold keys [start, end) into the running softmax state (m, denom, acc) of rows `q`.

    q: [M, HEAD_DIM]; pos: [M] position of each row; m, denom: [M] running max (log2 units) and
    sum; acc: [M, HEAD_DIM] float32. With MASKED=False every key in range must be visible to
    every row and (end - start) a multiple of BLOCK_N. Key j sits at

        k_ptr + block_table[j // BLOCK_SIZE] * stride_kb + (j % BLOCK_SIZE) * stride_kt
              + head_offset + d
    """
    dims = tl.arange(0, HEAD_DIM)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            col_ok = cols < end
            block = tl.load(table_ptr + cols // BLOCK_SIZE, mask=col_ok, other=0)
        else:
            block = tl.load(table_ptr + cols // BLOCK_SIZE)
        kv_offset = block.to(tl.int64) * stride_kb + (cols % BLOCK_SIZE) * stride_kt + head_offset
        if MASKED:
            k = tl.load(k_ptr + kv_offset[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + kv_offset[:, None] + dims[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            keep = col_ok[None, :] & (cols[None, :] <= pos[:, None])
            if USE_WINDOW:
                keep = keep & (cols[None, :] > pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
        m, denom, p, alpha = _online_softmax(s, m, denom, scale_log2)
        if MASKED:
            v = tl.load(v_ptr + kv_offset[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + kv_offset[:, None] + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m, denom, acc


@triton.jit
def attend_pages(
    q,
    m,
    denom,
    acc,
    k_desc,
    v_desc,
    table_ptr,
    head_col,
    pos,
    start,
    end,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_ACC: tl.constexpr = False,
):
    """`attend_tiles` over keys [start, end) (multiples of BLOCK_N), each tile one TMA load:
    BLOCK_SIZE % BLOCK_N == 0, so a tile never crosses a page. The descriptors view a cache as
    rows [num_blocks * BLOCK_SIZE, kv_heads * HEAD_DIM]; key j of kv head h is row
    `block_table[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE`, columns from head_col = h * HEAD_DIM.

    Every key in range must be written (a tile is loaded whole, and an unwritten slot may hold
    NaN); with CAUSAL, a row sees only the keys at or before its position `pos` (the diagonal band).
    """
    for n0 in range(start, end, BLOCK_N):
        row = tl.load(table_ptr + n0 // BLOCK_SIZE) * BLOCK_SIZE + n0 % BLOCK_SIZE
        k = k_desc.load([row, head_col])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if CAUSAL:
            cols = n0 + tl.arange(0, BLOCK_N)
            s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        v = v_desc.load([row, head_col])
        m, denom, p, alpha = _online_softmax(s, m, denom, scale_log2)
        if DOT_ACC:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m, denom, acc
