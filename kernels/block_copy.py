"""Copy whole KV blocks (all layers, K and V) between the paged cache and a block-major buffer.

Operations: `gather_blocks`, `scatter_blocks` (Triton) and `gather_blocks_ref`,
`scatter_blocks_ref` (plain torch, any device and dtype).

One block of one layer's K (or V) is a contiguous chunk of `block_size * kv_heads * head_dim`
elements in both layouts, so a copy is a list of chunk moves:

    kv_cache [L, 2, N, chunk]          staging [n, L, 2, chunk]
    chunk (l, c, block_ids[i])  <──►   chunk (i, l, c)          for i < n, l < L, c in {K, V}

    cache offset   = ((l * 2 + c) * N + block_ids[i]) * chunk
    staging offset = ((i * L + l) * 2 + c) * chunk

The kernel copies raw bits (the tensors are viewed as the widest integer type that divides the
chunk), so the copies are bit-exact for every dtype, NaN payloads included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_launchable, check_same_device, check_shape, check_tensor

_TILE_BYTES = 4096  # one 16-byte access per thread of 4 warps
_TILES_PER_PROGRAM = 8
_NUM_WARPS = 4


@triton.jit(do_not_specialize=["num_items"])
def _copy_blocks_kernel(
    cache_ptr,
    staging_ptr,
    block_ids_ptr,
    num_cache_blocks,
    num_items,
    CHUNKS_PER_BLOCK: tl.constexpr,
    PIECES: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    TILES: tl.constexpr,
    EVEN: tl.constexpr,
    TO_STAGING: tl.constexpr,
):
    """Item (chunk j, piece k) moves elements [k*TILES*TILE, (k+1)*TILES*TILE) of staging chunk
    j; program p moves items p, p + programs, ... (one each unless the grid is capped).

    The TILES tiles are unrolled so that each thread has TILES loads in flight.
    """
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        j = item // PIECES
        i = j // CHUNKS_PER_BLOCK
        lc = j % CHUNKS_PER_BLOCK  # l * 2 + c
        block = tl.load(block_ids_ptr + i)
        if (block >= 0) & (block < num_cache_blocks):
            cache = cache_ptr + (lc * num_cache_blocks + block) * CHUNK
            staging = staging_ptr + j.to(tl.int64) * CHUNK
            if TO_STAGING:
                src, dst = cache, staging
            else:
                src, dst = staging, cache
            first = (item % PIECES) * TILES * TILE
            for t in tl.static_range(TILES):
                offs = first + t * TILE + tl.arange(0, TILE)
                if EVEN:
                    tl.store(dst + offs, tl.load(src + offs))
                else:
                    mask = offs < CHUNK
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _check_copy_args(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, staging_name: str
) -> None:
    check_tensor("kv_cache", kv_cache, ndim=6)
    check_tensor("block_ids", block_ids, dtypes=(torch.int64,), ndim=1)
    check_tensor(staging_name, staging, dtypes=(kv_cache.dtype,), ndim=6)
    layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
    if two != 2:
        raise ValueError(f"kv_cache dim 1 must be 2 (K, V), got shape {tuple(kv_cache.shape)}")
    expected = (block_ids.shape[0], layers, 2, block_size, kv_heads, head_dim)
    check_shape(staging_name, staging, expected)


def _as_chunks(tensor: torch.Tensor, rows: int, chunk_bytes: int) -> torch.Tensor:
    """View a contiguous tensor as [rows, chunk] of the widest int type dividing the chunk."""
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = dtype.itemsize
        if chunk_bytes % size == 0 and tensor.data_ptr() % size == 0:
            return tensor.view(rows, -1).view(dtype)
    raise AssertionError("uint8 always divides")


def _launch_copy(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, to_staging: bool,
    max_programs: int | None,
) -> None:
    layers, _, num_cache_blocks = kv_cache.shape[:3]
    chunk_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    cache = _as_chunks(kv_cache, layers * 2 * num_cache_blocks, chunk_bytes)
    stage = _as_chunks(staging, staging.shape[0] * layers * 2, chunk_bytes)
    chunk = cache.shape[1]
    tile = min(triton.next_power_of_2(chunk), _TILE_BYTES // cache.element_size())
    tiles = min(_TILES_PER_PROGRAM, triton.cdiv(chunk, tile))
    pieces = triton.cdiv(chunk, tile * tiles)
    num_items = stage.shape[0] * pieces
    grid = (min(num_items, max_programs or num_items),)
    _copy_blocks_kernel[grid](
        cache, stage, block_ids, num_cache_blocks, num_items,
        CHUNKS_PER_BLOCK=layers * 2, PIECES=pieces, CHUNK=chunk, TILE=tile, TILES=tiles,
        EVEN=chunk % (tile * tiles) == 0, TO_STAGING=to_staging, num_warps=_NUM_WARPS,
    )


def _check_kernel_args(
    op: str, kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, name: str
) -> None:
    _check_copy_args(kv_cache, block_ids, staging, name)
    check_tensor("kv_cache", kv_cache, contiguous=True)
    check_tensor(name, staging, contiguous=True)
    device = check_same_device({"kv_cache": kv_cache, "block_ids": block_ids, name: staging})
    check_launchable(op, device, _copy_blocks_kernel)


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor, max_programs: int | None = None
) -> None:
    """Copy cache block `block_ids[i]` (all layers, K and V) into `out[i]`, bit-exact.

    kv_cache: [L, 2, N, block_size, kv_heads, head_dim], contiguous.
    block_ids: [n] int64, each in [0, N) (ids outside are skipped: `out[i]` is left unwritten;
    the reference raises). out: [n, L, 2, block_size, kv_heads, head_dim], contiguous, same
    dtype and device as kv_cache. max_programs: at most this many programs (CTAs), so that a
    copy running beside other kernels leaves them the rest of the SMs (None: one per 32 KiB).
    """
    _check_kernel_args("gather_blocks", kv_cache, block_ids, out, "out")
    if block_ids.numel() > 0:
        _launch_copy(kv_cache, block_ids, out, True, max_programs)


def scatter_blocks(
    src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, max_programs: int | None = None
) -> None:
    """Copy `src[i]` (all layers, K and V) into cache block `block_ids[i]`, bit-exact.

    Inverse of `gather_blocks`, same shapes and constraints. Repeated ids: one copy wins,
    unspecified which; ids outside [0, N) are skipped (the reference raises).
    """
    _check_kernel_args("scatter_blocks", kv_cache, block_ids, src, "src")
    if block_ids.numel() > 0:
        _launch_copy(kv_cache, block_ids, src, False, max_programs)


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Plain-torch `gather_blocks`; `out` may be on another device (e.g. pinned CPU memory)."""
    _check_copy_args(kv_cache, block_ids, out, "out")
    ids = block_ids.to(kv_cache.device)
    out.copy_(kv_cache[:, :, ids].permute(2, 0, 1, 3, 4, 5))


def scatter_blocks_ref(src: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Plain-torch `scatter_blocks`; `src` may be on another device (e.g. pinned CPU memory)."""
    _check_copy_args(kv_cache, block_ids, src, "src")
    ids = block_ids.to(kv_cache.device)
    kv_cache[:, :, ids] = src.to(kv_cache.device).permute(1, 2, 0, 3, 4, 5)
