"""Paged attention plugged into transformers models.

`register()` adds the attention implementation "tieredkv" to transformers'
`AttentionInterface`. transformers then hands each attention layer's post-RoPE q/k/v to
`paged_attention_forward`, which writes the new K/V into the paged cache and attends through
block tables. The metadata of the step travels in a `ForwardContext` set around the forward
pass (`forward_context(ctx)`).

Which ops run is decided in one place, `attention_ops(device)`: the Triton kernels on CUDA,
their plain-torch references elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "tieredkv"


@dataclass(frozen=True)
class ForwardContext:
    """Paged-attention metadata of one packed batch of B sequences and T new tokens.

    kv_cache      [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping  [T]      slot (block_id * block_size + offset) of each new token
    block_tables  [B, max_blocks] int32
    cu_seqlens_q  [B + 1]  int32, sequence b owns new tokens cu[b]:cu[b+1]
    context_lens  [B]      int32, cached + new tokens of each sequence
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor


class AttentionOps(NamedTuple):
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    gather_blocks: Callable[..., None]  # whole blocks cache -> staging (copy-on-write)
    scatter_blocks: Callable[..., None]  # and staging -> cache


def attention_ops(device: torch.device | str) -> AttentionOps:
    """Triton kernels on CUDA, plain-torch references elsewhere."""
    if torch.device(device).type == "cuda":
        from tieredkv.kernels.block_copy import gather_blocks, scatter_blocks
        from tieredkv.kernels.kv_store import store_kv
        from tieredkv.kernels.paged_attention import paged_attention

        return AttentionOps(store_kv, paged_attention, gather_blocks, scatter_blocks)
    from tieredkv.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
    from tieredkv.kernels.kv_store import store_kv_ref
    from tieredkv.kernels.paged_attention import paged_attention_ref

    return AttentionOps(store_kv_ref, paged_attention_ref, gather_blocks_ref, scatter_blocks_ref)


_state: dict[str, ForwardContext | AttentionOps | None] = {"ctx": None, "ops": None}


@contextlib.contextmanager
def forward_context(ctx: ForwardContext, ops: AttentionOps) -> Iterator[None]:
    """Make `ctx` the metadata that attention layers read during one forward pass."""
    _state["ctx"], _state["ops"] = ctx, ops
    try:
        yield
    finally:
        _state["ctx"] = _state["ops"] = None


def in_forward() -> bool:
    """Whether one of our forward passes is running."""
    return _state["ctx"] is not None


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: q/k/v are `[1, heads, T, head_dim]` (packed batch);
    returns `[1, T, heads, head_dim]`."""
    ctx, ops = _state["ctx"], _state["ops"]
    assert isinstance(ctx, ForwardContext) and isinstance(ops, AttentionOps), "paged attention outside forward_context"
    layer_cache = ctx.kv_cache[module.layer_idx]
    q = query[0].transpose(0, 1)
    # the kernels need only a contiguous last dim: the transposed views go in as they are
    ops.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer_cache[0], layer_cache[1], ctx.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ops.paged_attention(q, layer_cache[0], layer_cache[1], ctx.block_tables,
                              ctx.cu_seqlens_q, ctx.context_lens, scale, sliding_window=sliding_window)
    return out.unsqueeze(0), None


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
