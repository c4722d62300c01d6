"""Adversarial arguments to the Python API: text that is not valid Unicode, and chat messages the
engine cannot take, are a ValueError naming the argument (or an output with that error); list
content is read as its text parts; the engine keeps giving the tokens it gave before."""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv import LLM, AsyncLLM, SamplingParams
from tieredkv.config import EngineConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "swap or recompute?"}]


@pytest.fixture(scope="module")
def llm(chat_model_dir):
    with LLM(model=chat_model_dir, block_size=16, num_gpu_blocks=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def baseline(llm) -> list[int]:
    return llm.generate("the cache block", GREEDY, use_tqdm=False)[0].token_ids


def assert_still_serving(llm: LLM, baseline: list[int]) -> None:
    assert llm.generate("the cache block", GREEDY, use_tqdm=False)[0].token_ids == baseline
    stats = llm.stats()
    assert stats["requests_running"] == stats["requests_waiting"] == stats["gpu_blocks_used"] == 0


@pytest.mark.parametrize("text", ["the \ud800 cache", "\udfff", "cache \udbff\udbff"])
def test_a_lone_surrogate_is_a_value_error_naming_the_prompt(llm, baseline, text):
    with pytest.raises(ValueError, match=r"prompt: has a lone surrogate \(U\+D[8-F][0-9A-F]{2}\) at character \d+"):
        llm.add_request(text, GREEDY)
    [out] = llm.generate(text, GREEDY, use_tqdm=False)
    assert out.finish_reason == "error" and "lone surrogate" in out.error
    assert_still_serving(llm, baseline)


def test_a_lone_surrogate_in_a_stop_string_is_a_value_error_naming_stop():
    with pytest.raises(ValueError, match=r"stop: has a lone surrogate \(U\+D800\) at character 4"):
        SamplingParams(stop=["end", "stop\ud800"])


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "a \udc00"}], r"messages\[0\].content: has a lone surrogate"),
    ([{"role": "us\ud800er", "content": "hi"}], r"messages\[0\].role: expected one of"),
    ([{"role": "wizard", "content": "hi"}], r"messages\[0\].role: expected one of"),
    ([{"role": "function", "name": "f", "content": "42"}], r"messages\[0\].role: 'function' is not supported"),
    ([*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
     r"messages\[1\].tool_calls: not supported"),
    ([{"role": "user", "content": None}], r"messages\[0\].content: missing"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": 5}],
     r"messages\[1\].content: expected a string or a list of text parts, got int"),
    ([{"role": "user", "content": [{"type": "text", "text": ["x"]}]}], r"messages\[0\].content\[0\].text: expected"),
])
def test_chat_messages_the_engine_cannot_take_are_a_value_error(llm, baseline, messages, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert_still_serving(llm, baseline)


def test_a_bad_conversation_in_a_list_is_that_requests_error(llm, baseline):
    """It used to end the whole call, saying `messages[0]` for the second conversation."""
    [plain] = llm.chat(MESSAGES, GREEDY, use_tqdm=False)
    outs = llm.chat([MESSAGES, [{"role": "wizard", "content": "hi"}], [], "hi", MESSAGES], GREEDY, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert outs[0].token_ids == outs[4].token_ids == plain.token_ids
    assert outs[1].error.startswith("conversation 1: messages[0].role: expected one of")
    assert outs[2].error.startswith("conversation 2: messages: expected a non-empty list")
    assert outs[3].error.startswith("conversation 3: messages: expected a non-empty list")
    assert_still_serving(llm, baseline)

def test_list_content_is_its_text_parts(llm):
    text = [{"type": "text", "text": "swap or "}, {"type": "text", "text": "recompute?"}]
    parts = [{"role": "user", "content": text}]
    [plain] = llm.chat(MESSAGES, GREEDY, use_tqdm=False)
    assert llm.chat(parts, GREEDY, use_tqdm=False)[0].token_ids == plain.token_ids
    assert llm.chat([{"role": "assistant", "content": None}, *MESSAGES], GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("call, message", [
    (lambda llm: llm.add_request([5, 6], GREEDY, request_id=5), "request_id: expected a string, got int"),
    (lambda llm: llm.abort([1]), "request_id: expected a string, got list"),
    (lambda llm: llm.generate("hi", "greedy", use_tqdm=False),
     "sampling_params: expected a SamplingParams or one per prompt, got str"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY, {"temperature": 0}], use_tqdm=False),
     "sampling_params: expected a SamplingParams or one per prompt, got dict"),
    (lambda llm: llm.generate("hi", 3, use_tqdm=False),
     "sampling_params: expected a SamplingParams or one per prompt, got int"),
    (lambda llm: llm.add_request([5, 6], SamplingParams(max_tokens=2, logprobs=10**9)),
     r"logprobs: 1000000000 exceeds the vocabulary \(\d+ tokens\)"),
    (lambda llm: llm.chat(None, GREEDY, use_tqdm=False), "messages: expected a conversation .* got NoneType"),
    (lambda llm: llm.chat(MESSAGES[0], GREEDY, use_tqdm=False), "messages: expected a conversation .* got dict"),
])
def test_wrong_arguments_are_a_value_error_naming_them(llm, baseline, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)
    assert_still_serving(llm, baseline)


def test_numpy_values_are_taken_as_their_python_values():
    params = SamplingParams(max_tokens=np.int64(4), min_tokens=np.int64(1), skip_special_tokens=np.bool_(False))
    assert (params.max_tokens, params.min_tokens, params.skip_special_tokens) == (4, 1, False)
    assert type(params.min_tokens) is int and type(params.skip_special_tokens) is bool


def test_an_engine_key_given_by_position_is_a_type_error_naming_config():
    for engine in (LLM, AsyncLLM):
        with pytest.raises(TypeError, match="config: expected an EngineConfig, got 'cpu'; give the other engine keys"):
            engine("tiny-llama", "cpu")
    with pytest.raises(TypeError, match="config: expected an EngineConfig, got {'model': 'x'}"):
        AsyncLLM(config={"model": "x"})


@pytest.mark.parametrize("engine", [LLM, AsyncLLM])
def test_a_config_beside_keywords_or_another_model_is_a_value_error(engine):
    """They used to be ignored: the engine ran the config's model and sizes."""
    config = EngineConfig.from_kwargs(model="tiny-llama", device="cpu")
    with pytest.raises(ValueError, match="config: given with num_gpu_blocks, blok_size; set them in the config"):
        engine(config=config, num_gpu_blocks=99, blok_size=3)
    with pytest.raises(ValueError, match="model: 'tiny-qwen3' given with a config of model 'tiny-llama'"):
        engine("tiny-qwen3", config=config)
