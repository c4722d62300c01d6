"""Sampling parameters, string prompts through a tokenizer, and the `tieredkv` command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.reference import hf_greedy, make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.cli import main
from tieredkv.model.presets import build_preset

PROMPTS = make_prompts(vocab_size=512)[:4]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", block_size=4, num_gpu_blocks=128)


def tokens(llm, params):
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_same_seed_same_tokens_other_seed_other_tokens(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7)
    first = tokens(llm, params)
    assert tokens(llm, params) == first
    assert tokens(llm, SamplingParams(max_tokens=24, temperature=1.0, seed=8)) != first


def test_top_k_one_is_greedy(llm):
    greedy = tokens(llm, SamplingParams(max_tokens=16, temperature=0.0))
    assert tokens(llm, SamplingParams(max_tokens=16, temperature=0.7, top_k=1, seed=3)) == greedy
    assert tokens(llm, SamplingParams(max_tokens=16, temperature=0.7, top_p=1e-6, seed=3)) == greedy
    # 0 in float32: the most likely token still stays (every token used to be dropped: an error)
    assert tokens(llm, SamplingParams(max_tokens=16, temperature=0.7, top_p=1e-300, seed=3)) == greedy


def test_top_k_restricts_the_choice():
    from tieredkv.sampling import Sampler

    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(200, 1)
    params = [SamplingParams(temperature=2.0, top_k=2)] * 200
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    picked = set(Sampler().sample(logits, params, gens))
    assert picked == {0, 1}


def test_stop_tokens_and_eos(llm):
    greedy = tokens(llm, SamplingParams(max_tokens=16, temperature=0.0))
    stop = greedy[0][5]
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop])
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)
    first_stop = greedy[0].index(stop)
    assert out[0].token_ids == greedy[0][: first_stop + 1] and out[0].finish_reason == "stop"
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert out[0].finish_reason == "length"


def test_string_prompts_with_a_tokenizer(tmp_path):
    vocab = {f"w{i}": i for i in range(512)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(tmp_path)
    model = build_preset("tiny-llama", seed=0)
    model.save_pretrained(tmp_path)
    prompt = " ".join(f"w{t}" for t in PROMPTS[3])
    with torch.inference_mode():
        expected = hf_greedy(model, PROMPTS[3], 12)
    with LLM(model=str(tmp_path), num_gpu_blocks=32) as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert out.token_ids == expected
    # the text continues the prompt (prompt + text is the whole text), as vLLM's does
    assert out.text == "".join(f" w{t}" for t in expected)


def test_timings_are_ordered(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time and m.ttft >= 0


def test_cli_runs_the_default_config(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo's NVMe store goes under ./results
    (tmp_path / "configs").mkdir()
    from pathlib import Path

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    (tmp_path / "configs" / "demo.yaml").write_text(demo.read_text())
    assert main(["run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^requests +24 \(0 errors\)", out, re.M)
    assert "preemptions" in out and "TTFT p50 / p90 / p99" in out


def test_cli_help_and_errors(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "tieredkv.cli", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "run" in help_text.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-llama\ncache:\n  blok_size: 4\n")
    run = subprocess.run([sys.executable, "-m", "tieredkv.cli", "run", str(bad)], capture_output=True, text=True)
    assert run.returncode == 2 and "did you mean 'cache.block_size'" in run.stderr
    every_request_fails = tmp_path / "too_long.yaml"  # each answer longer than the model: every request fails
    every_request_fails.write_text("model: tiny-llama\ndevice: cpu\ncache: {num_gpu_blocks: 40}\nworkload:\n"
                                   "  {kind: multi_turn, users: 1, turns: 1, max_tokens: 100000}\n")
    run = subprocess.run([sys.executable, "-m", "tieredkv.cli", "run", str(every_request_fails), "--in-process",
                          "--no-progress", "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 1 and "all 1 of its requests failed" in run.stderr, run.stderr[-2000:]
    for args, flag in ((["serve", "--model", "tiny-llama", "--port", "99999"], "--port"),
                       (["run", str(bad), "--prometheus-port", "-5"], "--prometheus-port")):
        run = subprocess.run([sys.executable, "-m", "tieredkv.cli", *args], capture_output=True, text=True)
        assert run.returncode == 2 and f"argument {flag}: invalid port_number value" in run.stderr, run.stderr
