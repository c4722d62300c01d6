"""Configs as users write them: YAML's number quirks, missing and duplicate keys, sizes that do
not fit, `auto` defaults, `~` in paths, models in the Hugging Face cache. Every bad value is one
ValueError that names its key, raised before anything big is allocated."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch

from tieredkv import LLM
from tieredkv.config import CacheConfig, EngineConfig, parse_size, read_yaml
from tieredkv.model.presets import build_preset

README = Path(__file__).resolve().parents[1] / "README.md"


def yaml_config(tmp_path, text: str) -> EngineConfig:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return EngineConfig.from_dict(read_yaml(str(path)), extra_sections=("name", "workload", "variants"))


# ------------------------------------------------------------------ numbers as YAML reads them


def test_the_readme_yaml_loads(tmp_path):
    (block,) = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    config = yaml_config(tmp_path, block)
    cost = config.scheduler.cost_model
    assert (cost.d2h_bytes_per_s, cost.prefill_s_per_token, cost.disk_read_bytes_per_s) == (5.0e10, 3.0e-5, 2.0e9)
    assert isinstance(cost.d2h_bytes_per_s, float)


@pytest.mark.parametrize(
    "text, field, value",
    [
        ("cache: {num_gpu_blocks: 1e3}", ("cache", "num_gpu_blocks"), 1000),
        ("cache: {cpu_cache_bytes: 5e9}", ("cache", "cpu_cache_bytes"), 5_000_000_000),
        ("cache: {gpu_memory_utilization: '0.5'}", ("cache", "gpu_memory_utilization"), 0.5),
        ("scheduler: {max_num_batched_tokens: 4.096e3}", ("scheduler", "max_num_batched_tokens"), 4096),
        ("seed: 7.0", ("model", "seed"), 7),
    ],
)
def test_numbers_written_as_yaml_strings_or_floats_are_read(tmp_path, text, field, value):
    config = yaml_config(tmp_path, text)
    got = getattr(getattr(config, field[0]), field[1])
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_gpu_blocks": 40.5}, r"num_gpu_blocks: expected an integer >= 1, got 40.5"),
        ({"block_size": "sixteen"}, r"block_size: expected an integer in \[1, 1024\], got 'sixteen'"),
        ({"gpu_memory_utilization": "most"}, r"gpu_memory_utilization: expected a fraction in \(0, 1\]"),
        ({"max_num_seqs": float("nan")}, "max_num_seqs: expected an integer >= 1"),
        ({"scheduler": {"cost_model": {"d2h_bytes_per_s": "fast", "h2d_bytes_per_s": 1,
                                       "prefill_s_per_token": 1}}}, "cost_model.d2h_bytes_per_s: expected a"),
        ({"scheduler": {"cost_model": {"d2h_bytes_per_s": 1e9}}},
         "cost_model: missing h2d_bytes_per_s, prefill_s_per_token"),
        ({"scheduler": {"cost_model": {"d2h_bytes_per_s": 1, "h2d_bytes_per_s": 1,
                                       "prefill_s_per_token": -1}}}, "cost_model.prefill_s_per_token"),
        ({"nvme_path": 5, "nvme_bytes": "1GiB", "cpu_cache_bytes": "1MiB"},
         "nvme_path: expected a directory path, got 5"),
        ({"cpu_cache_bytes": "0.5B"}, r"cpu_cache_bytes: '0.5B' is not a whole number of bytes"),
        ({"max_model_len": "long"}, "max_model_len: expected an integer >= 1"),
    ],
)
def test_bad_numbers_name_their_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_sizes():
    assert parse_size("5e9") == 5_000_000_000 and parse_size(4e9) == 4_000_000_000
    assert parse_size("0.5KiB") == 512 and parse_size("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_size(0.5, "cpu_cache_bytes")


def test_duplicate_yaml_keys_are_an_error(tmp_path):
    with pytest.raises(ValueError, match="duplicate key 'block_size'"):
        yaml_config(tmp_path, "cache:\n  block_size: 4\n  num_gpu_blocks: 8\n  block_size: 16\n")
    with pytest.raises(ValueError, match="duplicate key 'model'"):
        yaml_config(tmp_path, "model: tiny-llama\nseed: 1\nmodel: tiny-qwen3\n")


# ------------------------------------------------------------------ sizes that do not fit


def test_a_gpu_tier_larger_than_memory_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"num_gpu_blocks: 100000000000 blocks .* available"):
        LLM(model="tiny-llama", num_gpu_blocks=10**11)


def test_a_cpu_tier_larger_than_memory_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"cpu_cache_bytes: .* available"):
        LLM(model="tiny-llama", num_gpu_blocks=8, cpu_cache_bytes="100TB")


def test_an_nvme_tier_smaller_than_one_slot_names_nvme_bytes(tmp_path):
    with pytest.raises(ValueError, match="nvme_bytes: 4096 bytes hold no slot") as info:
        LLM(model="tiny-llama", block_size=4, num_gpu_blocks=8, cpu_cache_bytes="64KiB",
            nvme_path=str(tmp_path / "kv"), nvme_bytes=4096, preemption="recompute")
    assert "capacity_bytes" not in str(info.value)


def test_max_model_len_beyond_the_models_positions_is_an_error():
    with pytest.raises(ValueError, match="max_model_len: 100000 exceeds the model's 4096 positions"):
        LLM(model="tiny-llama", num_gpu_blocks=8, max_model_len=100_000)


# ------------------------------------------------------------------ checks that need no model


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"preemption": "swap"}, "preemption: 'swap' needs a CPU tier; set cpu_cache_bytes"),
        ({"nvme_path": "/tmp/kv", "nvme_bytes": "1GiB"}, "nvme_path: the NVMe tier sits below the CPU tier"),
    ],
)
def test_cross_field_checks_fail_in_the_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_one_io_backend_type():
    from tieredkv.tiers.nvme import io_backends

    assert typing.get_type_hints(CacheConfig)["io_backend"] is io_backends.IOBackend
    allowed = "choose one of 'uring', 'aiofiles', 'sync'"
    with pytest.raises(ValueError, match=f"io_backend: 'spdk' is not allowed; {allowed}"):
        io_backends.make_backend("spdk")


# ------------------------------------------------------------------ defaults a GPU user expects


def test_device_and_dtype_default_to_auto():
    config = EngineConfig.from_kwargs()
    assert (config.model.device, config.model.dtype) == ("auto", "auto")
    with LLM(model="tiny-llama", num_gpu_blocks=8) as llm:
        expected_device = "cuda" if torch.cuda.is_available() else "cpu"
        assert (llm.config.model.device, llm.config.model.dtype) == (expected_device, "float32")
        assert llm.runner.kv_cache.dtype == torch.float32


def test_dtype_auto_is_the_checkpoints(tmp_path):
    build_preset("tiny-llama").to(torch.bfloat16).save_pretrained(tmp_path)
    with LLM(model=str(tmp_path), num_gpu_blocks=8) as llm:
        assert llm.config.model.dtype == "bfloat16" and llm.runner.kv_cache.dtype == torch.bfloat16


def test_cuda_without_cuda_is_one_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    EngineConfig.from_kwargs(device="cuda")  # a GPU config still validates on a laptop
    with pytest.raises(ValueError, match="device: 'cuda' but no CUDA device is available"):
        LLM(model="tiny-llama", device="cuda", num_gpu_blocks=8)


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    build_preset("tiny-llama").save_pretrained(tmp_path / "models" / "tiny")
    config = EngineConfig.from_kwargs(model="~/models/tiny", cpu_cache_bytes="1MiB", nvme_path="~/kv",
                                      nvme_bytes="1MiB")
    assert config.model.model == str(tmp_path / "models" / "tiny")
    assert config.cache.nvme_path == str(tmp_path / "kv")
    with LLM(model="~/models/tiny", num_gpu_blocks=8) as llm:
        assert llm.runner.model.config.num_hidden_layers == 2


def fake_hub_cache(root: Path, repo_id: str) -> Path:
    """The layout huggingface_hub leaves after a download: refs/main names a snapshot."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    build_preset("tiny-llama", seed=2).save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_a_model_id_in_the_hugging_face_cache_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = fake_hub_cache(tmp_path / "hub", "acme/tiny-chat")
    with LLM(model="acme/tiny-chat", num_gpu_blocks=8) as llm:
        assert llm.config.model.model == str(snapshot)
        assert llm.runner.model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="nor a model id in the Hugging Face cache"):
        LLM(model="acme/not-downloaded", num_gpu_blocks=8)
