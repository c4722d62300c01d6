"""RMS norm in one kernel, with the per-op rounding of transformers' `LlamaRMSNorm`.

Operations: `rms_norm` (Triton), `rms_norm_ref` (plain torch, any device), `row_layout` (the
rows of a [..., H] tensor as two strides; `silu_mul` uses it too).

LlamaRMSNorm is about eight torch kernels (to-float, pow, mean, add, rsqrt, mul, to-dtype, mul);
this is one program per row doing the same float32 steps in the same order:

    h   = float32(x)                        exact
    var = Σ h*h  ·  mean factor             CUDA: sum * float32(1/H);  CPU: sum / H  (as torch)
    h   = h * rsqrt(var + float32(eps))     rsqrt: CUDA's rsqrtf (libdevice), as torch's kernel
    out = weight * dtype(h)                 one float32 product rounded to the output dtype

Every step rounds where torch rounds, except the sum's order: torch's reduction tree (CUDA:
threads, vector lanes and warps laid out by its launch heuristics; CPU: SIMD cascades) is not
Triton's. The float32 sum of squares can then differ by a few ulps, and so can a float32
output (up to 5 ulps seen, in about one row in five); in float16/bfloat16 the difference
rarely survives the rounding of h (about 1e-5 of the outputs, by 1 or 2 ulps after the weight).
Rows whose sum is exact in float32 in any order (e.g. small integers) come out bit-exact.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from ._checks import FLOAT_DTYPES, check_launchable, check_same_device, check_shape, check_tensor

_MAX_HIDDEN = 65536  # one row lives in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    inner,
    stride_outer,
    stride_inner,
    eps,
    inv_hidden,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    MEAN_BY_RECIPROCAL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """One program per row: normalize x's row r into out's contiguous row r."""
    r = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (r // inner) * stride_outer + (r % inner) * stride_inner
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    square_sum = tl.sum(h * h, axis=0)
    if MEAN_BY_RECIPROCAL:  # torch's CUDA MeanOps: sum * float32(1 / H)
        var = square_sum * inv_hidden
    else:  # torch's CPU mean: sum().div_(H)
        var = tl.math.div_rn(square_sum, HIDDEN * 1.0)
    if LIBDEVICE:  # torch.rsqrt on CUDA calls rsqrtf, i.e. libdevice's __nv_rsqrtf
        scale = libdevice.rsqrt(var + eps)
    else:  # the interpreter's rsqrt is 1 / sqrt, as torch's on CPU
        scale = tl.math.rsqrt(var + eps)
    h = (h * scale).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * h.to(tl.float32)  # exact unless float32 is involved, as in torch
    tl.store(out_ptr + r * HIDDEN + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def row_layout(name: str, x: torch.Tensor) -> tuple[int, int, int, int]:
    """Rows of `x` [..., H] as `(num_rows, inner, stride_outer, stride_inner)`.

    Leading dims merge where their strides allow; at most two may remain:

        row r  ──►  x.data + (r // inner) * stride_outer + (r % inner) * stride_inner

    e.g. q = qkv[:, :heads * D].view(T, heads, D): rows T * heads, inner heads, strides
    (qkv.stride(0), D). The last dim itself must be contiguous (checked by the callers).
    """
    merged: list[tuple[int, int]] = []  # (size, stride), outermost first
    for size, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 2:
        raise ValueError(
            f"{name} with shape {tuple(x.shape)} and strides {x.stride()} has leading dims that "
            "do not merge into two strided ones; call .contiguous() first"
        )
    (outer, stride_outer), (inner, stride_inner) = merged + [(1, 0)] * (2 - len(merged))
    return outer * inner, inner, stride_outer, stride_inner


def _check_rms_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=1)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., H] with H >= 1, got {tuple(x.shape)}")
    check_shape("weight", weight, (x.shape[-1],))
    check_same_device({"x": x, "weight": weight})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm` with weight `weight` and epsilon `eps` applied to `x`, in one kernel.

    x: [..., H] float16/bfloat16/float32, last dim contiguous; leading dims may be strided
    (e.g. a [T, heads, head_dim] view of a fused projection). weight: [H], contiguous.
    Returns a new contiguous tensor of x's shape in dtype promote_types(x, weight), equal to
    `rms_norm_ref` except where the float32 sum of squares rounds differently (module doc).
    """
    _check_rms_args(x, weight)
    check_tensor("weight", weight, contiguous=True)
    hidden = x.shape[-1]
    if hidden > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"x needs a contiguous last dim, got strides {x.stride()}; call .contiguous()"
        )
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"H = {hidden} > {_MAX_HIDDEN} does not fit one program; use rms_norm_ref")
    check_launchable("rms_norm", x.device, _rms_norm_kernel)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    num_rows, inner, stride_outer, stride_inner = row_layout("x", x)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, weight, out, inner, stride_outer, stride_inner, float(eps),
        float(np.float32(num_rows) / np.float32(num_rows * hidden)),  # torch's CUDA factor
        HIDDEN=hidden, BLOCK=block, MEAN_BY_RECIPROCAL=x.device.type == "cuda",
        LIBDEVICE=not isinstance(_rms_norm_kernel, InterpretedFunction),
        num_warps=min(max(block // 512, 1), 8),
        enable_fp_fusion=False,  # an FMA would skip the rounding of h*h and of var
    )
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch `rms_norm`: transformers' `LlamaRMSNorm.forward`, op for op."""
    _check_rms_args(x, weight)
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)
