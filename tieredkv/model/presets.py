"""Model presets: architectures with random, seeded weights (no download).

Tiny presets run on a laptop CPU; full-size shapes (`llama-3-8b`, `qwen3-8b`, `llama-3-70b`)
are for GPU experiments. `initializer_range` is raised on the tiny ones so that random logits are
far from ties and greedy decoding is stable under tiny numerical differences.

Under tensor parallelism (`build_preset_shard`) a tiny preset is built whole and cut, so every
rank count runs the same weights; a full-size one is drawn directly in each rank's shape on its
device (a 70B model never exists whole anywhere), so its weights depend on the rank count.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from tieredkv.model.all_reduce import AllReduce
from tieredkv.model.sharding import TPLayout, parallelize, rank_config, shard_model

_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", _TINY),
    "tiny-qwen3": ("qwen3", {**_TINY, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 1}),
    "tiny-qwen2": ("qwen2", _TINY),
    "tiny-mistral": ("mistral", {**_TINY, "sliding_window": None}),
    "llama-3-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
    )),
    "llama-3-70b": ("llama", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
    )),
    # the 70B layer shape with 8 of its 80 layers: its compute per KV byte on one GPU (~9B weights)
    "llama-3-70b-8l": ("llama", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=8,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
    )),
    "qwen3-8b": ("qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
    )),
}


def preset_config(name: str) -> PretrainedConfig:
    if name not in PRESETS:
        presets = ", ".join(PRESETS)
        raise ValueError(f"model: unknown preset {name!r}; presets are {presets} (or pass a model directory)")
    model_type, kwargs = PRESETS[name]
    return AutoConfig.for_model(model_type, **kwargs)


def build_preset(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """The preset's model with weights drawn from `seed` (same seed, same weights).

    Weights are drawn in float32 on the CPU for tiny models (reproducible anywhere) and
    directly on the target device for large ones (an 8B model would take minutes on a CPU).
    """
    config = preset_config(name)
    init_device = "cpu" if name.startswith("tiny-") else device
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if init_device == "cpu" else dtype,
            attn_implementation=attn_implementation,
        )
    return model.to(device=device, dtype=dtype).eval()


def build_preset_shard(
    name: str, layout: TPLayout, all_reduce: AllReduce | None = None, seed: int = 0,
    dtype: torch.dtype = torch.float32, device: str = "cpu", attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Rank `layout.rank`'s share of the preset (module docstring: tiny ones are cut from the
    whole model, full-size ones drawn in their rank's shape, replicated weights alike on all)."""
    if name.startswith("tiny-"):
        model = build_preset(name, seed, dtype, device, attn_implementation)
        shard_model(model, layout, all_reduce)
        return model
    full = preset_config(name)
    layout.check(full)
    torch.manual_seed((seed * 1_000_003 + layout.rank) % 2**64)  # each rank draws its own shard
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            rank_config(full, layout), dtype=dtype, attn_implementation=attn_implementation
        )
    embedding = model.get_input_embeddings().weight
    generator = torch.Generator(device=device).manual_seed(seed)  # the same on every rank
    embedding.data.normal_(0.0, full.initializer_range, generator=generator)
    parallelize(model, layout, all_reduce)
    return model.eval()
