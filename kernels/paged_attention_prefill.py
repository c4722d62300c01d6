"""Prefill-shaped paged attention (tiled, tl.dot), used by `paged_attention` for prefill and
mixed batches.

Operation: `prefill_attention` (launcher; `paged_attention` validates the arguments first).

A program owns BLOCK_M consecutive rows of one query head of one sequence and walks the keys in
BLOCK_N tiles. Keys before the tile's first position are visible to every row, so those tiles skip
masking; only the diagonal band is masked:

    rows  p0 .. p0+BLOCK_M-1        keys 0 ─────────────── p0 ──────── p0+BLOCK_M
                                         | unmasked tiles  | masked (causal) |

With a sliding window every tile is masked (rows see different lower bounds).

Two ways to read the tiles, chosen by the launch config (`config_for`):
- gathered: each key row's address from the block table, any block size (`attend_tiles`); the
  band's tiles by masked loads;
- paged TMA (Hopper and newer, 16-bit caches, block_size a multiple of BLOCK_N): a tile lies
  inside one page and comes in one tensor-memory-accelerator load (`attend_pages`), the band's
  too, masked in registers; only a tile reaching past the sequence's last key (its slots beyond
  are not written) is read by masked loads. The grid then runs the query heads fastest (the heads
  of a kv head read the same tiles at about the same time) and the sequences' last query tiles,
  which see the most keys, first.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._attention_common import LOG2_E, attend_pages, attend_tiles, find_seq
from ._checks import check_launchable


# per-step sizes are not specialized on: one compiled kernel serves every batch
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, q_desc, k_desc, v_desc, out_ptr,
    table_ptr, cu_q_ptr, ctx_ptr,
    num_seqs, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SKIP_SINGLE_ROW_SEQS: tl.constexpr,
    PAGED_TMA: tl.constexpr, DOT_ACC: tl.constexpr = False,
):
    if PAGED_TMA:  # grid (head, tile), last tiles first
        head = tl.program_id(0)
        pid = tl.num_programs(1) - 1 - tl.program_id(1)
    else:  # grid (tile, head)
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
    if PAGED_TMA:  # rows past q_len are the next sequence's (or zeros): computed, not stored
        q = q_desc.load([q_start + row0, head * HEAD_DIM])
    else:
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=row_ok[:, None], other=0.0,
        )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = table_ptr + b * stride_bt
    kv_head = head // GROUP
    head_offset = kv_head * stride_kh
    end = tl.minimum(first_pos + BLOCK_M, ctx)
    if USE_WINDOW:
        start = tl.maximum(first_pos + 1 - window, 0)
        m, denom, acc = attend_tiles(
            q, m, denom, acc, k_ptr, v_ptr, table, head_offset, pos, start, end, window,
            scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, True, PRECISION,
        )
    else:
        full_end = first_pos // BLOCK_N * BLOCK_N
        if PAGED_TMA:  # whole tiles by TMA, the band's too; a tile reaching past `ctx` by pointers
            band_end = tl.maximum(full_end, end // BLOCK_N * BLOCK_N)
            head_col = kv_head * HEAD_DIM
            m, denom, acc = attend_pages(
                q, m, denom, acc, k_desc, v_desc, table, head_col, pos, 0, full_end,
                scale_log2, BLOCK_SIZE, BLOCK_N, False, PRECISION, DOT_ACC,
            )
            m, denom, acc = attend_pages(
                q, m, denom, acc, k_desc, v_desc, table, head_col, pos, full_end, band_end,
                scale_log2, BLOCK_SIZE, BLOCK_N, True, PRECISION, DOT_ACC,
            )
        else:
            band_end = full_end
            m, denom, acc = attend_tiles(
                q, m, denom, acc, k_ptr, v_ptr, table, head_offset, pos, 0, full_end, window,
                scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False,
                PRECISION,
            )
        m, denom, acc = attend_tiles(
            q, m, denom, acc, k_ptr, v_ptr, table, head_offset, pos, band_end, end, window,
            scale_log2, stride_kb, stride_kt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, PRECISION,
        )
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# Paged TMA where no tuned config is on record for the card: the best of a sweep on an H200, bf16,
# head_dim 128 (BENCHMARKS.md, "Prefill attention from whole pages by TMA").
PAGED_TMA_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "paged_tma": True}

# Paged TMA configs tuned per GPU kind by `benchmarks/tune_prefill.py --write`:
# {device name: {"<dtype>/<head_dim>": {"config": {...}, ...what the sweep measured}}}.
TUNED_CONFIGS = Path(__file__).with_name("prefill_tuned.json")


def default_config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Tile sizes and launch options of the gathered kernel (tuned on an H200 for bf16,
    head_dim 128; smaller tiles where float32 or a wide head would overflow shared memory)."""
    if dtype == torch.float32 or head_dim >= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def tuned_key(dtype: torch.dtype, head_dim: int) -> str:
    """The key of a dtype and head size in a device's entry of TUNED_CONFIGS ("bfloat16/128")."""
    return f"{str(dtype).removeprefix('torch.')}/{head_dim}"


@functools.cache
def tuned_config(device_name: str, dtype: torch.dtype, head_dim: int) -> dict[str, int] | None:
    """The paged TMA config tuned on this kind of GPU for this dtype and head size, or None."""
    try:
        table = json.loads(TUNED_CONFIGS.read_text())
    except FileNotFoundError:
        return None
    entry = table.get(device_name, {}).get(tuned_key(dtype, head_dim))
    return {**entry["config"], "paged_tma": True} if entry else None


def config_for(query: torch.Tensor, block_size: int) -> dict[str, int]:
    """The launch config for this batch's dtype, head size, block size and device: paged TMA
    where the device has a tensor memory accelerator (compute capability 9+), the cache is 16-bit,
    each page holds whole tiles and the query rows can be TMA tiles (the config tuned on this kind
    of GPU if one is on record, else PAGED_TMA_CONFIG); else the gathered kernel's
    `default_config`."""
    head_dim = query.shape[2]
    if (
        query.device.type == "cuda"
        and _has_tma(query.device)
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_dim <= 128
        and query.stride(1) == head_dim  # the query's rows as one [T, heads * head_dim] matrix,
        and (query.stride(0) * query.element_size()) % 16 == 0  # TMA-aligned
        and query.data_ptr() % 16 == 0
    ):
        tuned = tuned_config(_device_name(query.device), query.dtype, head_dim)
        for config in (tuned, PAGED_TMA_CONFIG):
            if config and block_size % config["BLOCK_N"] == 0:
                return config
    return default_config(query.dtype, head_dim)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9+ (ROCm reports its own architectures as capabilities)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _descriptors(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int, block_n: int
) -> tuple[TensorDescriptor, ...]:
    """TMA descriptors: the query as rows [T, heads * head_dim] in tiles of [block_m, head_dim]
    (one head's rows: loaded into shared memory, where the matrix units read it, it takes no
    registers); the caches as rows [num_blocks * block_size, kv_heads * head_dim] in tiles of
    [block_n, head_dim] (one kv head's block_n consecutive keys of one page)."""
    num_rows, num_heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    q_desc = TensorDescriptor(query, [num_rows, num_heads * head_dim], [query.stride(0), 1],
                              [block_m, head_dim])
    shape, strides = [num_blocks * block_size, kv_heads * head_dim], [kv_heads * head_dim, 1]
    return q_desc, *(
        TensorDescriptor(cache, shape, strides, [block_n, head_dim]) for cache in (k_cache, v_cache)
    )


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
    config: BLOCK_M, BLOCK_N, num_warps, num_stages and optionally paged_tma (block_size must then
    be a multiple of BLOCK_N); None picks by `config_for`.
    """
    check_launchable("paged_attention", query.device, _prefill_kernel)
    num_rows, num_heads, head_dim = query.shape
    if num_rows == 0:
        return
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    config = dict(config or config_for(query, block_size))
    paged_tma = config.pop("paged_tma", False)
    tiles = num_rows // config["BLOCK_M"] + num_seqs
    if paged_tma:
        if block_size % config["BLOCK_N"] != 0:
            raise ValueError(
                f"paged TMA needs block_size ({block_size}) to be a multiple of BLOCK_N "
                f"({config['BLOCK_N']})"
            )
        descriptors = _descriptors(query, k_cache, v_cache, config["BLOCK_M"], config["BLOCK_N"])
        grid = (num_heads, tiles)
    else:
        descriptors = (query, k_cache, v_cache)  # not read
        grid = (tiles, num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, *descriptors, out,
        block_tables, cu_seqlens_q, context_lens,
        num_seqs, scale * LOG2_E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SKIP_SINGLE_ROW_SEQS=skip_single_row_seqs, PAGED_TMA=paged_tma, **config,
    )
