"""Where a model comes from and what "auto" means for it, decided before anything is loaded.

Operations: `resolve(config)` (the model config with the model located and "auto" decided),
`locate_model(name)` (a preset, a local directory, or the snapshot directory of a model id in the
Hugging Face cache), `checkpoint_dtype(model)`, `resolve_device(device)`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tieredkv.config import ModelConfig
from tieredkv.model.presets import PRESETS

DTYPES = ("float32", "float16", "bfloat16")


def resolve(config: ModelConfig) -> ModelConfig:
    """The same config with the model located and "auto" decided; ValueError if the model is
    not found or the device is missing. Reads the model's config.json, no weights."""
    model = locate_model(config.model)
    dtype = config.dtype if config.dtype != "auto" else checkpoint_dtype(model)
    return dataclasses.replace(config, model=model, device=resolve_device(config.device), dtype=dtype)


def locate_model(name: str) -> str:
    """A preset name, a local model directory, or the snapshot directory of a model id already
    downloaded to the Hugging Face cache (`HF_HUB_CACHE`); ValueError otherwise."""
    if name in PRESETS or os.path.isdir(name):
        return name
    snapshot = hub_snapshot(name)
    if snapshot is not None:
        return snapshot
    raise ValueError(
        f"model: {name!r} is neither a preset ({', '.join(PRESETS)}), a local model directory, "
        f"nor a model id in the Hugging Face cache ({_hub_cache_dir()}); give a directory, or "
        f"download it first (`huggingface-cli download {name}`)"
    )


def hub_snapshot(repo_id: str) -> str | None:
    """The cached snapshot directory of `repo_id` at its main revision, or None. Never downloads."""
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(repo_id, "config.json", cache_dir=_hub_cache_dir())
    except ValueError:  # not a valid repo id (huggingface_hub's HFValidationError)
        return None
    return os.path.dirname(config) if isinstance(config, str) else None


def _hub_cache_dir() -> str:
    """`HF_HUB_CACHE` as set now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def checkpoint_dtype(model: str) -> str:
    """The dtype a checkpoint was saved in (config.json `dtype` or `torch_dtype`) if it is one
    we run, else float32; presets run in float32."""
    if model in PRESETS:
        return "float32"
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "float32"
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in DTYPES else "float32"


def resolve_device(device: str) -> str:
    """"cuda" or "cpu" for "auto"; ValueError for "cuda" on a machine without CUDA."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device: 'cuda' but no CUDA device is available (torch.cuda.is_available() is False); "
            "use device: cpu, or auto to take CUDA where there is one"
        )
    return device
