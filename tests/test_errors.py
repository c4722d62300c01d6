"""Bad configuration and bad input get errors that name what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tieredkv import LLM, SamplingParams
from tieredkv.config import EngineConfig, parse_size


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", block_size=4, num_gpu_blocks=16, max_model_len=48)


@pytest.mark.parametrize(
    "text, expected",
    [("512MiB", 512 * 2**20), ("4GiB", 4 * 2**30), ("1.5GB", 1_500_000_000), ("4096", 4096), (123, 123)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4 gigs", "GiB", "-1MiB", "1.2.3GiB", True, -5])
def test_bad_size_names_the_key(bad):
    with pytest.raises(ValueError, match="cpu_cache_bytes"):
        EngineConfig.from_kwargs(cpu_cache_bytes=bad)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"blok_size": 4}, "unknown key 'blok_size': did you mean 'block_size'"),
        ({"cache": {"num_gpu_blok": 4}}, "did you mean 'cache.num_gpu_blocks'"),
        ({"device": "tpu"}, "device: 'tpu' is not allowed; choose one of 'cpu', 'cuda'"),
        ({"dtype": "fp8"}, "dtype: 'fp8' is not allowed"),
        ({"block_size": 0}, r"block_size: expected an integer in \[1, 1024\], got 0"),
        ({"preemption": "drop"}, "preemption: 'drop' is not allowed"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization: expected a fraction in \(0, 1\]"),
        ({"nvme_bytes": "1GiB"}, "set nvme_path"),
        ({"cpu_cache_bytes": "1e400"}, r"cpu_cache_bytes: '1e400' is more bytes than any machine has"),
        ({"seed": 2**64}, r"seed: expected an integer in \[0, 18446744073709551615\]"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\ncache: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        LLM.from_yaml(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model: tiny-llama\nschedular:\n  max_num_seqs: 4\n")
    with pytest.raises(ValueError, match="unknown key 'schedular': did you mean 'scheduler'"):
        LLM.from_yaml(str(unknown))
    with pytest.raises(ValueError, match="does not exist"):
        LLM.from_yaml(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"cannot read .* \(Is a directory\)"):
        LLM.from_yaml(str(tmp_path))
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match="nests its mappings and lists too deeply"):
        LLM.from_yaml(str(deep))


def test_a_large_engine_seed_still_seeds_every_sampled_request():
    """The engine's seed derives each request's generator seed: it used to overflow past ~1.8e13
    and fail every sampled request without a seed of its own."""
    with LLM(model="tiny-llama", block_size=4, num_gpu_blocks=16, seed=2**64 - 1) as llm:
        outs = llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=3, temperature=1.0), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "length"] and all(len(o.token_ids) == 3 for o in outs)


def test_unknown_model():
    with pytest.raises(ValueError, match="neither a preset"):
        LLM(model="no-such-model")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens: expected an integer >= 1"),
        ({"temperature": -1}, "temperature: expected a number >= 0"),
        ({"top_p": 0}, r"top_p: expected a number in \(0, 1\]"),
        ({"top_k": 0}, "top_k: expected an integer >= 1"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        # stop conditions are checked at every token: one request may not slow every other's steps
        ({"stop": ["x"] * 257}, "stop: at most 256 strings of at most 1024 characters each, got 257"),
        ({"stop": ["x" * 1025]}, "stop: at most 256 strings .* got 1 of up to 1025 characters"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids: at most 1024 token ids, got 1025"),
        ({"stop": [""] * 10**5}, r"stop: expected a non-empty string .* \(\d+ characters\)"),  # quoted cut short
        ({"min_tokens": 20}, r"min_tokens: expected an integer in \[0, max_tokens=16\]"),
    ],
)
def test_sampling_param_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt: is empty"),
        ([1, 2, 99999], r"token ids must be integers in \[0, 512\)"),
        ("hello", "needs a tokenizer"),
        (list(range(46)), "exceeds the model's maximum length 48"),
    ],
)
def test_bad_request_is_rejected_alone(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompt, SamplingParams(max_tokens=10))
    good = [5, 6, 7]
    outs = llm.generate([good, prompt, good], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert outs[1].finish_reason == "error" and outs[1].error is not None
    assert outs[1].token_ids == []
    assert len(outs[0].token_ids) == len(outs[2].token_ids) == 4


def test_request_larger_than_the_cache_is_rejected():
    small = LLM(model="tiny-llama", block_size=4, num_gpu_blocks=4)
    with pytest.raises(ValueError, match="need 5 KV blocks but the GPU tier has 4"):
        small.add_request([1] * 12, SamplingParams(max_tokens=5))


def test_from_yaml_reads_the_demo_config(tmp_path):
    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    no_disk = demo.read_text().replace("nvme_path: ${results}/nvme", "nvme_path: null")
    assert "nvme_path: null" in no_disk
    config = tmp_path / "demo.yaml"
    config.write_text(no_disk.replace("nvme_bytes: 16MiB", "nvme_bytes: 0"))
    with LLM.from_yaml(str(config)) as llm:
        assert llm.config.cache.block_size == 16 and llm.config.cache.num_gpu_blocks == 40
        assert llm.config.scheduler.preemption == "auto" and llm.kv.offload is not None
        outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        assert len(outs[0].token_ids) == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_with_every_token_banned_fails_alone(llm, temperature):
    """min_tokens bans EOS and stop_token_ids until it is reached: with all of the vocabulary
    listed, no token can be drawn, greedy or not. That request ends with an error saying so (it
    used to get token 0, banned, when greedy); the others in its steps run on."""
    vocab = llm.runner.hf_config.vocab_size
    every = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(vocab)), temperature=temperature)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    alone = llm.generate([[5, 6, 7]], plain, use_tqdm=False)[0]
    outs = llm.generate([[5, 6, 7], [8, 9], [5, 6, 7]], [plain, every, plain], use_tqdm=False)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    assert "every one is banned" in outs[1].error or "not finite" in outs[1].error
    assert outs[0].token_ids == outs[2].token_ids == alone.token_ids
