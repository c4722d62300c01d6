"""Write new K/V rows into the paged cache.

Operations: `store_kv` (Triton), `store_kv_ref` (plain torch, any device and dtype).

A slot is `block_id * block_size + offset`; the cache of one layer viewed as rows:

    k_cache [num_blocks, block_size, kv_heads, head_dim]
      == rows [num_blocks * block_size, kv_heads * head_dim]     row index = slot

    key[t] ──► rows[slot_mapping[t]]        (slot_mapping[t] < 0: padding, skipped)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    FLOAT_DTYPES,
    check_launchable,
    check_same_device,
    check_shape,
    check_tensor,
)


# per-step sizes are not specialized on: one compiled kernel serves every batch
@triton.jit(do_not_specialize=["num_slots"])
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per token: copy its K row and V row (kv_heads * head_dim) into its slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if (slot < 0) | (slot >= num_slots):
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + head * stride_vh + dim, mask=mask)
    row = slot.to(tl.int64) * ROW
    tl.store(k_cache_ptr + row + offs, k, mask=mask)
    tl.store(v_cache_ptr + row + offs, v, mask=mask)


def _check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_tensor("key", key, ndim=3)
    check_tensor("k_cache", k_cache, ndim=4, contiguous=True)
    check_tensor("v_cache", v_cache, ndim=4, contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1)
    check_shape("value", value, key.shape)
    check_shape("v_cache", v_cache, k_cache.shape)
    num_tokens, kv_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)}; expected [num_blocks, block_size, "
            f"{kv_heads}, {head_dim}] to match key's (kv_heads, head_dim)"
        )
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != key.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}; expected key's {key.dtype}")
    check_same_device(
        {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
         "slot_mapping": slot_mapping}
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key[t]`/`value[t]` into cache slot `slot_mapping[t]`; negative slots are skipped.

    key, value: [T, kv_heads, head_dim], last dim contiguous (any token/head stride).
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], contiguous, same dtype.
    slot_mapping: [T] int64. Slots past the cache are skipped too (no device-side error; the
    reference raises). Two tokens with one slot: one of them wins, unspecified which.
    """
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    check_tensor("key", key, dtypes=FLOAT_DTYPES)
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError(
            f"key and value need a contiguous last dim, got strides {key.stride()} and "
            f"{value.stride()}; call .contiguous()"
        )
    check_launchable("store_kv", key.device, _store_kv_kernel)
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = kv_heads * head_dim
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        HEAD_DIM=head_dim, ROW=row, BLOCK=triton.next_power_of_2(row),
        num_warps=4 if row >= 512 else 1,
    )


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch `store_kv` for any device and dtype; raises IndexError on slots past the cache."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_heads, head_dim = key.shape[1:]
    k_cache.view(-1, kv_heads, head_dim)[slots] = key[keep]
    v_cache.view(-1, kv_heads, head_dim)[slots] = value[keep]
