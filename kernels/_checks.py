"""Argument checks shared by the kernel wrappers.

Every check raises `ValueError` with what is wrong and what is expected, so a caller can fix the
call without reading the kernel. Checks look at shapes, dtypes, strides and devices only: none
reads tensor values, so none forces a host-device sync. Messages are formatted only on failure
(the checks run on every decode step of every layer).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    contiguous: bool = False,
) -> None:
    """Check one argument's type, dtype, rank and (optionally) contiguity."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        wanted = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of {wanted}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (strides {tensor.stride()} for shape "
            f"{tuple(tensor.shape)}); pass a contiguous tensor or call .contiguous()"
        )


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    """Check that `tensor.shape == expected`."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(expected)}")


def check_same_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """Check that all tensors share one device and return it."""
    devices = [t.device for t in tensors.values()]
    if any(d != devices[0] for d in devices):
        where = ", ".join(f"{n}={t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    return devices[0]


def check_launchable(op: str, device: torch.device, kernel: object) -> None:
    """Check that `kernel` can run on `device`: CUDA, or CPU under the Triton interpreter.

    The interpreter is chosen when the kernel module is imported (`@triton.jit` reads
    TRITON_INTERPRET then), so setting the variable later does not help.
    """
    if device.type == "cuda" or isinstance(kernel, InterpretedFunction):
        return
    hint = ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        hint = " (TRITON_INTERPRET=1 is set, but only after tieredkv.kernels was imported)"
    raise ValueError(
        f"{op} needs CUDA tensors, got device {device}. On CPU call {op}_ref instead, or set "
        f"TRITON_INTERPRET=1 before importing tieredkv.kernels to run the kernel in Triton's "
        f"interpreter{hint}"
    )


def check_head_dim(head_dim: int) -> None:
    """Triton tiles need a power-of-two head_dim (at least 16 for tl.dot)."""
    if head_dim < 16 or head_dim & (head_dim - 1) != 0:
        raise ValueError(
            f"head_dim {head_dim} is not supported by the Triton kernels: it must be a power of "
            "two >= 16 (16, 32, 64, 128, 256); use paged_attention_ref for other sizes"
        )
