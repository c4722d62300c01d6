"""Tensor-parallel sharding of a decoder (Llama, Mistral, Qwen2, Qwen3), transformers' plan:

    q/k/v_proj, gate/up_proj   column-parallel: rank r keeps its rows (its heads, its columns)
    o_proj, down_proj          row-parallel: rank r keeps the matching input columns; the
                               partial outputs are summed by an all-reduce
    lm_head                    column-parallel over the vocabulary, logits all-gathered
    embed_tokens, norms        replicated

KV heads: with K KV heads on N ranks, rank r holds heads [r*K/N, (r+1)*K/N) when N divides K.
When K < N (N a multiple of K), each KV head is replicated on N/K consecutive ranks: rank r
holds head r // (N/K), exactly the head its query heads (r*Q/N ... ) read, so attention stays
local. Every rank then stores one KV head of every block: the KV tiers hold N/K copies of each
head (one per rank, each on its own GPU and in its own CPU tier).

    Q=4, K=1, N=2:  rank 0: q heads 0,1 + kv head 0     rank 1: q heads 2,3 + kv head 0

Operations: `TPLayout(rank, world)` (`check`, `kv_heads`, `describe`), `shard_model(model,
layout, all_reduce)` for a full model, `parallelize(model, layout, all_reduce)` for one built with
`rank_config` shapes. `all_reduce` (`tieredkv.model.all_reduce`) sums the row-parallel outputs
over its process group, which also gathers the logits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tieredkv.model.all_reduce import AllReduce


@dataclass(frozen=True)
class TPLayout:
    """Which share of the model rank `rank` of `world` holds."""

    rank: int
    world: int

    def check(self, hf: PretrainedConfig) -> None:
        """ValueError (naming tensor_parallel_size) if the model cannot be split `world` ways."""
        q, k = hf.num_attention_heads, num_kv_heads(hf)
        parts = {"attention heads": q, "MLP columns (intermediate_size)": hf.intermediate_size}
        for what, n in parts.items():
            if n % self.world:
                raise ValueError(
                    f"tensor_parallel_size: {self.world} does not divide the model's {n} {what}; "
                    f"choose a divisor of {n}"
                )
        if k % self.world and self.world % k:
            raise ValueError(
                f"tensor_parallel_size: {self.world} neither divides nor is a multiple of the model's {k} KV heads; "
                f"choose a divisor or a multiple of {k}"
            )

    def q_heads(self, hf: PretrainedConfig) -> range:
        per_rank = hf.num_attention_heads // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, hf: PretrainedConfig) -> range:
        """The KV heads this rank holds (one replicated head when there are fewer than ranks)."""
        k = num_kv_heads(hf)
        if k >= self.world:
            per_rank = k // self.world
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        head = self.rank // (self.world // k)
        return range(head, head + 1)

    def vocab_parallel(self, hf: PretrainedConfig) -> bool:
        """The LM head is split over the vocabulary (else every rank holds all of it)."""
        return hf.vocab_size % self.world == 0

    def describe(self, hf: PretrainedConfig) -> str:
        """The layout as the model fingerprint records it: KV written under another layout
        has other bytes per rank and is never read."""
        k = num_kv_heads(hf)
        kv = f"{len(self.kv_heads(hf))} kv heads per rank" if k >= self.world else f"kv heads x{self.world // k}"
        return f"tp={self.world}; q heads split; {kv}; vocab parallel={self.vocab_parallel(hf)}"


def num_kv_heads(hf: PretrainedConfig) -> int:
    return getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads


def head_dim(hf: PretrainedConfig) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def rank_config(hf: PretrainedConfig, layout: TPLayout) -> PretrainedConfig:
    """A config whose modules have one rank's shapes (its heads, its MLP columns; the whole
    vocabulary): build a model from it, then `parallelize` it."""
    config = copy.deepcopy(hf)
    config.head_dim = head_dim(hf)
    config.num_attention_heads = len(layout.q_heads(hf))
    config.num_key_value_heads = len(layout.kv_heads(hf))
    config.intermediate_size = hf.intermediate_size // layout.world
    return config


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x @ W_r^T) + b`: rank r holds the input columns of its share."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Module):
    """The LM head split over the vocabulary: each rank computes its rows' logits, then every
    rank gathers all of them (`[..., vocab]`, in vocabulary order)."""

    def __init__(self, weight: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.world = world
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(_has_tp_modules(layer) for layer in layers):
        raise ValueError(
            f"model: {type(model).__name__} is not a decoder this engine can split across ranks "
            "(self_attn.q/k/v/o_proj and mlp.gate/up/down_proj); run it with tensor_parallel_size: 1"
        )
    return layers


def _has_tp_modules(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) and all(
        hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")
    )


@torch.no_grad()
def shard_model(model: nn.Module, layout: TPLayout, all_reduce: AllReduce | None = None) -> None:
    """Cut a full model down to rank `layout.rank`'s share, in place, and install the
    all-reduces and the logits gather (None: `dist.all_reduce` over the default group)."""
    hf = model.config
    layout.check(hf)
    d = head_dim(hf)
    q = _rows(layout.q_heads(hf), d)
    kv = _rows(layout.kv_heads(hf), d)
    cols = hf.intermediate_size // layout.world
    mlp = slice(layout.rank * cols, (layout.rank + 1) * cols)
    for layer in decoder_layers(model):
        attn, ff = layer.self_attn, layer.mlp
        _keep_rows(attn.q_proj, q)
        _keep_rows(attn.k_proj, kv)
        _keep_rows(attn.v_proj, kv)
        _keep_rows(ff.gate_proj, mlp)
        _keep_rows(ff.up_proj, mlp)
        attn.o_proj.weight.data = attn.o_proj.weight.data[:, q].clone()
        ff.down_proj.weight.data = ff.down_proj.weight.data[:, mlp].clone()
    parallelize(model, layout, all_reduce)


def parallelize(model: nn.Module, layout: TPLayout, all_reduce: AllReduce | None = None) -> None:
    """Replace o_proj and down_proj (already holding this rank's input columns) by row-parallel
    layers summing through `all_reduce` (None: `dist.all_reduce` over the default group), and
    the LM head by this rank's rows of it, gathering the logits over the same group. (The head's
    weight is copied, not cut: it may be tied to the embedding, which stays whole.)"""
    all_reduce = all_reduce or AllReduce()
    for layer in decoder_layers(model):
        layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj, all_reduce)
        layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj, all_reduce)
    hf = model.config
    if layout.vocab_parallel(hf):
        vocab = hf.vocab_size // layout.world
        rows = model.lm_head.weight.data[layout.rank * vocab : (layout.rank + 1) * vocab].clone()
        model.lm_head = VocabParallelHead(rows, layout.world, all_reduce.group)


def _rows(heads: range, dim: int) -> slice:
    return slice(heads.start * dim, heads.stop * dim)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight.data = linear.weight.data[rows].clone()
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[rows].clone()
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, all_reduce: AllReduce) -> RowParallelLinear:
    bias = None if linear.bias is None else linear.bias.data
    return RowParallelLinear(linear.weight.data, bias, all_reduce)
