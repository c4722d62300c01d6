"""Triton kernels with host wrappers and plain-torch references (installed as `tieredkv.kernels`)."""

from .block_copy import gather_blocks, gather_blocks_ref, scatter_blocks, scatter_blocks_ref
from .kv_store import store_kv, store_kv_ref
from .paged_attention import paged_attention, paged_attention_ref
from .rms_norm import rms_norm, rms_norm_ref
from .rotary import apply_rotary, apply_rotary_ref
from .silu_mul import silu_mul, silu_mul_ref

__all__ = [
    "apply_rotary",
    "apply_rotary_ref",
    "gather_blocks",
    "gather_blocks_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "scatter_blocks",
    "scatter_blocks_ref",
    "silu_mul",
    "silu_mul_ref",
    "store_kv",
    "store_kv_ref",
]
