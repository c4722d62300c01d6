"""Fused replacements for the small elementwise ops of transformers decoder layers.

A decode step of Llama-3-8B at batch 64 launched 1,373 kernels on the H200, most of them tiny:
each RMSNorm is eight (to float, pow, mean, add, rsqrt, mul, to dtype, weight mul), the rotary
embedding about ten, SiLU·up two. Each op here is one kernel and bit-exact with transformers'
formula (same per-op rounding), so greedy tokens do not change.

`install(model, device)` swaps, per module instance, the forward of every RMSNorm and SiLU MLP,
and routes the architecture's `apply_rotary_pos_emb` through the fused op while one of our
forward passes runs (other users of transformers in the process keep theirs). On CUDA the ops are
the Triton kernels; elsewhere their plain-torch references, so CPU runs exercise the same wiring.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from tieredkv.model import attention


class FusedOps(NamedTuple):
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def fused_ops(device: torch.device | str) -> FusedOps:
    """Triton kernels on CUDA, plain-torch references elsewhere."""
    return _ops_for(torch.device(device).type)


@functools.cache
def _ops_for(device_type: str) -> FusedOps:
    if device_type == "cuda":
        from tieredkv.kernels.rms_norm import rms_norm
        from tieredkv.kernels.rotary import apply_rotary
        from tieredkv.kernels.silu_mul import silu_mul

        return FusedOps(rms_norm, apply_rotary, silu_mul)
    from tieredkv.kernels.rms_norm import rms_norm_ref
    from tieredkv.kernels.rotary import apply_rotary_ref
    from tieredkv.kernels.silu_mul import silu_mul_ref

    return FusedOps(rms_norm_ref, apply_rotary_ref, silu_mul_ref)


def install(model: nn.Module, device: torch.device | str) -> None:
    """Fuse what the model's modules allow."""
    ops = fused_ops(device)
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward(ops.rms_norm), module)
        elif name.endswith("MLP") and _is_silu_mlp(module):
            module.forward = types.MethodType(_mlp_forward(ops.silu_mul), module)
    _route_rotary(sys.modules[type(model).__module__])


def _rms_norm_forward(rms_norm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    return forward


def _is_silu_mlp(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return (
        all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
        and getattr(config, "hidden_act", None) == "silu"
    )


def _mlp_forward(silu_mul: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    return forward


def _route_rotary(modeling: types.ModuleType) -> None:
    """Make the modeling module's `apply_rotary_pos_emb` (looked up at each call by its
    attention layers) take the fused op of the tensors' device inside our forward passes."""
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if original is None or hasattr(original, "unfused"):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        if unsqueeze_dim == 1 and not kwargs and attention.in_forward():
            return _ops_for(q.device.type).apply_rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim, **kwargs)

    apply_rotary_pos_emb.unfused = original
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
