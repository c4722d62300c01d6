"""Triton kernels with host wrappers and plain-torch references (installed as `tieredkv.kernels`)."""

from .block_copy import gather_blocks, gather_blocks_ref, scatter_blocks, scatter_blocks_ref
from .kv_store import store_kv, store_kv_ref
from .paged_attention import paged_attention, paged_attention_ref

__all__ = [
    "gather_blocks",
    "gather_blocks_ref",
    "paged_attention",
    "paged_attention_ref",
    "scatter_blocks",
    "scatter_blocks_ref",
    "store_kv",
    "store_kv_ref",
]
