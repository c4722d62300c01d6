"""`LLM.beam_search`: the candidates of transformers `generate(num_beams=W)` (float32, CPU),
token for token, with beams forking, dropped and preempted (swap and recompute) on a GPU
budget that cannot hold them all."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.reference import hf_beams, make_prompts
from tieredkv import LLM, BeamSearchParams, SamplingParams
from tieredkv.model.presets import build_preset

PROMPTS = make_prompts(vocab_size=512)[3:6]  # 40, 49 and 33 tokens, the first 33 shared by all
MAX_TOKENS = 8


def candidates(out) -> list[tuple[list[int], float]]:
    return [(s.token_ids, s.score) for s in out.sequences]


def assert_same_beams(ours, expected) -> None:
    """The same candidates in the same order, scores within float32 noise."""
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in expected]
    assert [score for _, score in ours] == pytest.approx([score for _, score in expected], abs=1e-4)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize(("preset", "preemption"), [("tiny-llama", "swap"), ("tiny-qwen3", "recompute"),
                                                    ("tiny-mistral", "swap")])
def test_beam_search_matches_transformers(preset, preemption, width):
    model = build_preset(preset, seed=0)
    with torch.inference_mode():
        expected = [hf_beams(model, p, width, MAX_TOKENS) for p in PROMPTS]
    # 20 blocks of 4 tokens: one beam of the longest prompt needs 15, the beams of all three
    # prompts about 3 x (10 + width x 3)
    with LLM(model=preset, block_size=4, num_gpu_blocks=20, max_num_batched_tokens=32,
             cpu_cache_bytes="256KiB", preemption=preemption) as llm:
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS), use_tqdm=False)
        llm.kv.offload.drain()
        stats = llm.stats()
    for out, want in zip(outs, expected, strict=True):
        assert_same_beams(candidates(out), want)
        assert out.sequences[0].cum_logprob == pytest.approx(out.sequences[0].score * MAX_TOKENS, abs=1e-4)
    assert stats["preemptions"][preemption] > 0 and stats["cow_block_copies"] > 0
    assert stats["gpu_blocks_used"] == 0 and stats["cpu_blocks_used"] == 0


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory) -> str:
    """tiny-llama with every third token an EOS id: beams end all the time, so hypotheses fill
    up early and the stopping rule, not max_tokens, ends most searches."""
    path = tmp_path_factory.mktemp("many-eos")
    model = build_preset("tiny-llama", seed=0)
    model.config.eos_token_id = model.generation_config.eos_token_id = list(range(3, 512, 3))
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(("prompt", "length_penalty"), [(5, 2.0), (3, 1.0), (1, 0.5)])
def test_beams_that_end_in_eos_follow_transformers_rules(eos_model_dir, prompt, length_penalty):
    prompt, width = make_prompts(vocab_size=512)[prompt], 4
    reference = AutoModelForCausalLM.from_pretrained(eos_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf_beams(reference, prompt, width, 16, length_penalty)
    params = BeamSearchParams(beam_width=width, max_tokens=16, length_penalty=length_penalty)
    with LLM(model=eos_model_dir, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=32) as llm:
        out = llm.beam_search([prompt], params, use_tqdm=False)[0]
        assert llm.stats()["gpu_blocks_used"] == 0
    assert_same_beams(candidates(out), expected)
    assert "stop" in [s.finish_reason for s in out.sequences]
    assert max(len(s.token_ids) for s in out.sequences) < 16  # stopped before max_tokens
    for s in out.sequences:
        assert s.score == pytest.approx(s.cum_logprob / len(s.token_ids) ** length_penalty)
        assert (s.finish_reason == "stop") == (s.token_ids[-1] in range(3, 512, 3))


def test_beam_search_with_a_tokenizer_returns_text(chat_model_dir):
    with LLM(model=chat_model_dir, num_gpu_blocks=64) as llm:
        out = llm.beam_search(["the cache block"], BeamSearchParams(beam_width=3, max_tokens=6), use_tqdm=False)[0]
        decode = llm.tokenizer.decode
    assert len(out.sequences) == 3
    for s in out.sequences:
        assert s.text == decode(s.token_ids, skip_special_tokens=True)


def test_beam_search_errors():
    with pytest.raises(ValueError, match="beam_width: expected an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="length_penalty: expected a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    # a score divides by tokens ** length_penalty: past 1.8e308 it used to raise OverflowError mid-search
    with pytest.raises(ValueError, match=r"length_penalty: expected a number in \[-512.0, 512.0\] with max_tokens=4"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1000.0)
    with LLM(model="tiny-llama", num_gpu_blocks=16, max_num_seqs=2) as llm:
        fine, too_long = llm.beam_search([[1, 2], list(range(3, 300))], BeamSearchParams(2, 4), use_tqdm=False)
        assert fine.error is None and len(fine.sequences) == 2
        assert too_long.sequences == [] and "need 19 KV blocks but the GPU tier has 16" in too_long.error
        for params in (None, SamplingParams(max_tokens=4)):  # the call's fault: raised, as by generate
            with pytest.raises(ValueError, match="params: expected a BeamSearchParams"):
                llm.beam_search([[1, 2], [3]], params, use_tqdm=False)
        out = llm.beam_search([[1, 2]], BeamSearchParams(3, 4), use_tqdm=False)[0]
        assert out.sequences == [] and "beam_width: 3 sequences per request exceed max_num_seqs (2)" in out.error
        llm.add_request([1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="beam_search: 1 request"):
            llm.beam_search([[1, 2]], BeamSearchParams(2, 4))
