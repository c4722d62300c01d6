"""Greedy outputs equal transformers `generate(do_sample=False)` token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.reference import hf_greedy, make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.model.presets import build_preset

NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def longest_request_blocks(prompts: list[list[int]], block_size: int) -> int:
    return -(-(max(map(len, prompts)) + NEW_TOKENS) // block_size)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("block_size", [4, 16, 64])
@pytest.mark.parametrize("pressure", [False, True], ids=["large-cache", "tiny-cache"])
def test_greedy_matches_transformers(preset, block_size, pressure, reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs(preset, prompts, NEW_TOKENS)
    # under pressure: room for the longest request plus a little, and small prefill chunks
    num_blocks = longest_request_blocks(prompts, block_size) + 2 if pressure else 512
    llm = LLM(model=preset, block_size=block_size, num_gpu_blocks=num_blocks,
              max_num_batched_tokens=24 if pressure else 2048)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    if pressure:
        assert stats["preemptions"]["recompute"] > 0
        if block_size <= 16:  # requests of at most 110 tokens seldom fill a 64-token block
            # preempted requests come back and find their own full blocks in the cache
            assert stats["prefix_hit_tokens"] > 0
    else:
        assert stats["preemptions"]["recompute"] == 0
    # every request finished: nothing but cached blocks is left
    assert stats["gpu_blocks_used"] == 0


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-mistral"])
def test_model_directory_matches_transformers(preset, tmp_path):
    build_preset(preset, seed=3).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = make_prompts(vocab_size=512, seed=1)[:5]
    with torch.inference_mode():
        expected = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    with LLM(model=str(tmp_path), block_size=8, num_gpu_blocks=24, max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["preemptions"]["recompute"] > 0
    assert [o.token_ids for o in outs] == expected


def test_repeated_generate_reuses_prefix_and_stays_exact(reference_outputs):
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    llm = LLM(model="tiny-llama", block_size=16, num_gpu_blocks=256)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits = llm.stats()["prefix_hit_tokens"]
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == expected
    # second round: every prompt's full blocks (but never its last token) come from the cache
    expected_hits = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert llm.stats()["prefix_hit_tokens"] - hits == expected_hits
    assert [o.metrics.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in prompts]


def test_fused_ops_replace_the_elementwise_ops_of_our_forward_only(monkeypatch):
    from tieredkv.model import fused

    calls: dict[str, int] = dict.fromkeys(fused.FusedOps._fields, 0)
    real = fused._ops_for("cpu")

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    spies = fused.FusedOps(*(counted(n, f) for n, f in zip(fused.FusedOps._fields, real, strict=True)))
    monkeypatch.setattr(fused, "_ops_for", lambda device_type: spies)
    llm = LLM(model="tiny-llama", num_gpu_blocks=64)
    calls.update(dict.fromkeys(calls, 0))  # the cost model's prefill probes at start-up are not counted
    layers = llm.runner.model.config.num_hidden_layers
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    forwards = 3
    assert calls == {"rms_norm": (2 * layers + 1) * forwards, "apply_rotary": layers * forwards,
                     "silu_mul": layers * forwards}
    # transformers' own forward passes keep transformers' ops
    hf = build_preset("tiny-llama", 0, torch.float32, "cpu", "eager")
    hf(torch.tensor([[1, 2, 3]]))
    assert calls["apply_rotary"] == layers * forwards


def test_the_warm_up_of_eager_steps_runs_their_shapes_and_leaves_the_engine_exact(reference_outputs):
    """Before serving, a CUDA engine runs once each eager step shape that picks a kernel variant
    (a chunk past the mixed graphs after a long context, beside 0, 1, 2, 4 decodes, at two
    block-table widths), so that none compiles while requests wait. The same steps on the CPU: they fit the pool and the
    model's positions, and the tokens stay exact after them (they write only the KV of blocks
    no request holds yet)."""
    prompts = make_prompts(vocab_size=512)
    with LLM(model="tiny-llama", block_size=16, num_gpu_blocks=64, max_num_seqs=8) as llm:
        steps = llm.runner.warm_eager_steps(max_batch=8, chunk=300)
        # tables of 64 and 63 blocks (1,024 and 1,008 tokens), less the chunk
        assert steps == [(d, 724) for d in (0, 1, 2, 4)] + [(d, 708) for d in (0, 1, 2, 4)]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference_outputs("tiny-llama", prompts, NEW_TOKENS)
