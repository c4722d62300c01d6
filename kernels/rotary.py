"""Rotary position embedding of q and k in one kernel, with transformers' per-op rounding.

Operations: `apply_rotary` (Triton), `apply_rotary_ref` (plain torch, any device).

Neox layout ("rotate_half"): a head row x of D dims is two halves [x1 | x2], and

    out = [x1*c1 + (-x2)*s1 | x2*c2 + x1*s2]        c = cos[b, t], s = sin[b, t]

where, as in `apply_rotary_pos_emb` run in a 16-bit dtype, each product is rounded to the dtype
and then their sum is (torch computes every elementwise op in float32 and rounds the result).

Grid (token, head): token i = b * T + t; heads [0, Hq) are q's, [Hq, Hq + Hk) are k's.
The outputs are laid out [B, T, H, D] in memory (shape [B, H, T, D], like q and k), so

    out[b, h, t, :]  at  ((i * H) + h) * D          and  out.transpose(1, 2) is contiguous.
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

_MAX_HEAD_DIM = 256


@triton.jit
def _rotate_row(src, dst, cos_row, sin_row, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Rotate one head row: read src[0:D], write dst[0:D] (D = 2 * HALF)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    dtype = dst.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask).to(tl.float32)
    c1 = tl.load(cos_row + offs, mask=mask).to(tl.float32)
    c2 = tl.load(cos_row + HALF + offs, mask=mask).to(tl.float32)
    s1 = tl.load(sin_row + offs, mask=mask).to(tl.float32)
    s2 = tl.load(sin_row + HALF + offs, mask=mask).to(tl.float32)
    # q * cos and rotate_half(q) * sin are rounded to the dtype before they are added
    out1 = (x1 * c1).to(dtype).to(tl.float32) + ((-x2) * s1).to(dtype).to(tl.float32)
    out2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(dst + offs, out1.to(dtype), mask=mask)
    tl.store(dst + HALF + offs, out2.to(dtype), mask=mask)


# the sequence length changes every step: not specialized on
@triton.jit(do_not_specialize=["seq_len"])
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    seq_len,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_cb,
    stride_ct,
    stride_sb,
    stride_st,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (token i, head h): rotate head h of token i, a q head if h < Q_HEADS, else k."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = i // seq_len
    t = i % seq_len
    cos_row = cos_ptr + b * stride_cb + t * stride_ct
    sin_row = sin_ptr + b * stride_sb + t * stride_st
    if h < Q_HEADS:
        src = q_ptr + b * stride_qb + h * stride_qh + t * stride_qt
        _rotate_row(src, q_out_ptr + (i * Q_HEADS + h) * 2 * HALF, cos_row, sin_row, HALF, BLOCK)
    else:
        kh = h - Q_HEADS
        src = k_ptr + b * stride_kb + kh * stride_kh + t * stride_kt
        _rotate_row(src, k_out_ptr + (i * K_HEADS + kh) * 2 * HALF, cos_row, sin_row, HALF, BLOCK)


def _check_rotary_args(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("k", k, dtypes=(q.dtype,), ndim=4)
    check_tensor("cos", cos, dtypes=(q.dtype,), ndim=3)
    check_tensor("sin", sin, dtypes=(q.dtype,), ndim=3)
    batch, _, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"k has shape {tuple(k.shape)}; expected [{batch}, kv_heads, {seq_len}, {head_dim}] "
            "to match q's [B, heads, T, D]"
        )
    check_shape("cos", cos, (batch, seq_len, head_dim))
    check_shape("sin", sin, (batch, seq_len, head_dim))
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim {head_dim} is odd; rotate_half needs an even head_dim")
    check_same_device({"q": q, "k": k, "cos": cos, "sin": sin})


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim=1), bit-exact.

    q: [B, Hq, T, D], k: [B, Hk, T, D], float16/bfloat16/float32, last dim contiguous (e.g.
    `proj(x).view(B, T, H, D).transpose(1, 2)`). cos, sin: [B, T, D] in q's dtype, last dim
    contiguous (a broadcast batch dim, stride 0, is fine). D even, at most 256.
    Returns (q_out, k_out) shaped like q and k, laid out [B, T, H, D] in memory.
    """
    _check_rotary_args(q, k, cos, sin)
    batch, q_heads, seq_len, head_dim = q.shape
    k_heads = k.shape[1]
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {_MAX_HEAD_DIM}; use apply_rotary_ref")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} needs a contiguous last dim, got strides {t.stride()}; "
                "call .contiguous()"
            )
    check_launchable("apply_rotary", q.device, _rotary_kernel)
    q_out = q.new_empty((batch, seq_len, q_heads, head_dim)).transpose(1, 2)
    k_out = k.new_empty((batch, seq_len, k_heads, head_dim)).transpose(1, 2)
    if batch * seq_len == 0 or q_heads + k_heads == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(batch * seq_len, q_heads + k_heads)](
        q, k, cos, sin, q_out, k_out, seq_len,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        Q_HEADS=q_heads, K_HEADS=k_heads, HALF=half, BLOCK=triton.next_power_of_2(half),
        num_warps=1,
        enable_fp_fusion=False,  # in float32 an FMA would skip the products' rounding
    )
    return q_out, k_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `apply_rotary`: transformers' `apply_rotary_pos_emb`, op for op."""
    _check_rotary_args(q, k, cos, sin)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
