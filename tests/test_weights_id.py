"""The weights' identity changes whenever any weight byte does, so KV written for other weights
(here: by an engine before the checkpoint was rewritten in place) is never read."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.reference import hf_greedy, settle_writes
from tieredkv import LLM, SamplingParams
from tieredkv.model import weights

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
LOAD_WINS = {"d2h_bytes_per_s": 1e15, "h2d_bytes_per_s": 1e15, "prefill_s_per_token": 1e-3,
             "disk_read_bytes_per_s": 1e15}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The on-disk digest cache lives in the test's folder; the in-process one starts empty."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(weights, "_digests", {}, raising=False)


def save_llama(path) -> None:
    """A 4-layer Llama of ~3 MiB: layer 1's weights lie more than 1 MiB from both file ends."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def negate_layer_1(path) -> None:
    """Rewrite the checkpoint in place with layer 1's two output projections negated."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.neg_()
        model.model.layers[1].self_attn.o_proj.weight.neg_()
    model.save_pretrained(path)


def engine(model_dir, nvme_dir) -> LLM:
    # an LRU CPU tier writes every block it demotes (one pass fills the store)
    return LLM(model=str(model_dir), block_size=16, num_gpu_blocks=8, cpu_cache_bytes="256KiB", cpu_policy="lru",
               nvme_path=str(nvme_dir), nvme_bytes="8MiB", io_backend="sync", preemption="recompute",
               scheduler={"cost_model": LOAD_WINS})


def expected_tokens(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_weights_rewritten_in_place_never_reuse_stale_kv(tmp_path):
    model_dir, nvme_dir = tmp_path / "model", tmp_path / "nvme"
    save_llama(model_dir)
    (weight_file,) = [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    size_before = os.path.getsize(model_dir / weight_file)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(48)] for _ in range(4)]
    with engine(model_dir, nvme_dir) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert settle_writes(llm)["nvme_spilled_blocks"] > 0
    with engine(model_dir, nvme_dir) as llm:  # same weights: the store serves the documents
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["nvme_loaded_blocks"] > 0

    negate_layer_1(model_dir)
    assert os.path.getsize(model_dir / weight_file) == size_before
    expected = expected_tokens(model_dir, prompts)
    with engine(model_dir, nvme_dir) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        loaded = llm.stats()["nvme_loaded_blocks"]
    assert [o.token_ids for o in outs] == expected
    assert loaded == 0


def test_any_byte_changes_the_id_even_with_the_same_size_and_mtime(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = model_dir / "model.safetensors"
    data = bytearray(os.urandom(5 << 20))
    path.write_bytes(data)
    os.utime(path, ns=(10**18, 10**18))  # an old file: its digest may be cached
    before = weights.weights_id(str(model_dir))
    assert weights.weights_id(str(model_dir)) == before
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    os.utime(path, ns=(10**18, 10**18))  # as `cp -p` or `rsync -t` would leave it
    assert weights.weights_id(str(model_dir)) != before


def test_a_cached_digest_notices_a_rewrite_that_keeps_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "RACY_S", 0.0)  # cache even a file written just now
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = model_dir / "model.safetensors"
    data = bytearray(os.urandom(3 << 20))
    path.write_bytes(data)
    os.utime(path, ns=(10**18, 10**18))
    before = weights.weights_id(str(model_dir))
    time.sleep(0.05)  # past the next timestamp tick: the rewrite gets another ctime
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    os.utime(path, ns=(10**18, 10**18))
    assert weights.weights_id(str(model_dir)) != before


def test_the_digest_is_cached_in_process_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "RACY_S", 0.0)  # ctime cannot be set back: cache it anyway
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = model_dir / "model.safetensors"
    path.write_bytes(os.urandom(3 << 20))
    os.utime(path, ns=(10**18, 10**18))
    hashed: list[str] = []
    file_digest = weights._hash_file

    def spy(p: str) -> str:
        hashed.append(p)
        return file_digest(p)

    monkeypatch.setattr(weights, "_hash_file", spy)
    first = weights.weights_id(str(model_dir))
    assert weights.weights_id(str(model_dir)) == first and len(hashed) == 1
    monkeypatch.setattr(weights, "_digests", {})  # a new process: the file under XDG_CACHE_HOME
    assert weights.weights_id(str(model_dir)) == first and len(hashed) == 1
    assert (tmp_path / "xdg" / "tieredkv" / "weight_digests.json").exists()


def test_a_file_modified_just_now_is_hashed_again(tmp_path, monkeypatch):
    # timestamps tick coarsely: two writes within one tick can leave size and mtime alike
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(os.urandom(1 << 20))
    hashed: list[str] = []
    file_digest = weights._hash_file
    monkeypatch.setattr(weights, "_hash_file", lambda p: hashed.append(p) or file_digest(p))
    weights.weights_id(str(model_dir))
    weights.weights_id(str(model_dir))
    assert len(hashed) == 2
