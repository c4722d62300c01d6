"""SwiGLU's `silu(gate) * up` in one kernel, with torch's per-op rounding.

Operations: `silu_mul` (Triton), `silu_mul_ref` (plain torch, any device).

As torch does it (every elementwise op in float32, its result rounded to the dtype):

    s   = dtype(g / (1 + exp(-g)))          g = float32(gate); exp: CUDA's expf (libdevice)
    out = dtype(s * up)                     one float32 product

Grid (row, column block): rows as in `row_layout`, BLOCK columns of I per program; the output
is a new contiguous tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from ._checks import FLOAT_DTYPES, check_launchable, check_same_device, check_shape, check_tensor
from .rms_norm import row_layout

_MAX_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_inner,
    gate_stride_outer,
    gate_stride_inner,
    up_inner,
    up_stride_outer,
    up_stride_inner,
    COLS: tl.constexpr,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Program (r, c): columns [c * BLOCK, (c + 1) * BLOCK) of row r."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < COLS
    gate_row = gate_ptr + (r // gate_inner) * gate_stride_outer
    gate_row += (r % gate_inner) * gate_stride_inner
    up_row = up_ptr + (r // up_inner) * up_stride_outer + (r % up_inner) * up_stride_inner
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_row + offs, mask=mask).to(tl.float32)
    if LIBDEVICE:  # torch's CUDA silu calls expf, i.e. libdevice's __nv_expf (not ex2.approx)
        e = libdevice.exp(-g)
    else:  # interpreter: numpy's float32 exp is often an ulp off; float64 rounds correctly
        e = tl.exp(-g.to(tl.float64)).to(tl.float32)
    s = tl.math.div_rn(g, 1.0 + e).to(dtype)  # IEEE division, as torch's (Triton's `/` is not)
    u = tl.load(up_row + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + r * COLS + offs, (s.to(tl.float32) * u).to(dtype), mask=mask)


def _check_silu_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    check_tensor("up", up, dtypes=(gate.dtype,))
    if gate.dim() == 0:
        raise ValueError("gate must have shape [..., I], got a 0-dim tensor")
    check_shape("up", up, gate.shape)
    check_same_device({"gate": gate, "up": up})


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in one kernel, bit-exact with torch in every float dtype.

    gate, up: [..., I], same shape and dtype (float16/bfloat16/float32), last dim contiguous;
    leading dims may be strided (e.g. the halves of a fused gate_up projection).
    Returns a new contiguous tensor of gate's shape.
    """
    _check_silu_args(gate, up)
    cols = gate.shape[-1]
    for name, t in (("gate", gate), ("up", up)):
        if cols > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} needs a contiguous last dim, got strides {t.stride()}; call .contiguous()"
            )
    check_launchable("silu_mul", gate.device, _silu_mul_kernel)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    num_rows, gate_inner, gate_outer_stride, gate_inner_stride = row_layout("gate", gate)
    _, up_inner, up_outer_stride, up_inner_stride = row_layout("up", up)
    if out.numel() == 0:
        return out
    block = min(triton.next_power_of_2(cols), _MAX_BLOCK)
    _silu_mul_kernel[(num_rows, triton.cdiv(cols, block))](
        gate, up, out, gate_inner, gate_outer_stride, gate_inner_stride,
        up_inner, up_outer_stride, up_inner_stride,
        COLS=cols, BLOCK=block, LIBDEVICE=not isinstance(_silu_mul_kernel, InterpretedFunction),
        num_warps=4 if block >= 512 else 1,
    )
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-torch `silu_mul`: `F.silu(gate) * up`."""
    _check_silu_args(gate, up)
    return torch.nn.functional.silu(gate) * up
