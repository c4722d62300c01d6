"""Text out of the engine: incremental detokenization, stop strings, special tokens, EOS lists
from config.json and generation_config.json, min_tokens, chat."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests.checkpoint import END, EOS, save_checkpoint
from tests.reference import hf_greedy
from tieredkv import LLM, AsyncLLM, SamplingParams
from tieredkv.text import IncrementalDetokenizer

PROMPTS = ["the cache block", "swap recompute prefix", "café naïve", "東京 über the"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(chat_model_dir):
    with LLM(model=chat_model_dir, num_gpu_blocks=64) as llm:
        yield llm


def generate(llm: LLM, prompt: str, **params) -> object:
    return llm.generate(prompt, SamplingParams(**{"max_tokens": 24, "temperature": 0.0, **params}), use_tqdm=False)[0]


# ---------------------------------------------------------------- incremental detokenization


@pytest.mark.parametrize("text", ["the cache block tier", "café naïve 東京 über!", "ñ 😀 cache €uro"])
def test_deltas_add_up_to_the_text_and_never_split_a_character(chat_model_dir, text):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    prompt, output = tokenizer.encode("a swap "), tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = []
    for token in output:
        assert detok.add(token) is None
        deltas.append(detok.take_delta(finished=False))
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    if "😀" in text:  # characters unseen in training are single bytes: 4 tokens, one delta
        assert deltas.count("") >= 3


def test_half_a_character_at_the_end_is_flushed(chat_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    tokens = tokenizer.encode("ab 😀")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for token in tokens[:-1]:  # the emoji's last byte never comes
        detok.add(token)
    assert detok.take_delta(finished=False) == "ab "
    assert detok.flush() is None and detok.take_delta(finished=True) == "\ufffd"


def test_stop_string_across_tokens_is_held_back_and_cut(chat_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["block tier", "zzz"]))
    seen, stop = "", None
    for token in tokenizer.encode("the cache block tier offload"):
        stop = detok.add(token)
        seen += detok.take_delta(finished=stop is not None)
        assert "block" not in seen  # held back while it may start a stop string
        if stop:
            break
    assert stop == "block tier" and seen == detok.text == "the cache "


# ---------------------------------------------------------------- stop strings, min_tokens


def test_stop_strings_cut_the_text_and_stop_the_request(llm):
    full = generate(llm, PROMPTS[0], ignore_eos=True)
    assert len(full.token_ids) == 24 and len(full.text) > 20
    stop = full.text[12:15]
    out = generate(llm, PROMPTS[0], ignore_eos=True, stop=[stop, "never there"])
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and len(out.token_ids) < 24
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    # the request ended at the token that completed the stop string
    shorter = llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    assert stop not in shorter


async def test_streamed_deltas_add_up_and_hold_back_a_stop_string(chat_model_dir, llm):
    full = generate(llm, PROMPTS[1], ignore_eos=True)
    stop = full.text[10:14]
    allm = AsyncLLM(model=chat_model_dir, num_gpu_blocks=64)
    text, outs = "", []
    async for out in allm.generate_stream(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0,
                                                                     ignore_eos=True, stop=stop)):
        text += out.text_delta
        assert out.text == text  # each output's text is everything handed out so far
        outs.append(out)
    await allm.close()
    assert text == full.text[: full.text.index(stop)] and outs[-1].finish_reason == "stop"
    assert len(outs) == len(outs[-1].token_ids)  # one output per token


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    full = generate(llm, PROMPTS[2], ignore_eos=True)
    first_stop = full.token_ids[1]
    early = generate(llm, PROMPTS[2], stop_token_ids=[first_stop])
    assert early.token_ids == full.token_ids[:2] and early.finish_reason == "stop"
    late = generate(llm, PROMPTS[2], stop_token_ids=[first_stop], min_tokens=6)
    assert late.token_ids[0] == full.token_ids[0]
    assert first_stop not in late.token_ids[:6] and len(late.token_ids) >= 7


def test_bad_text_params_name_the_field():
    with pytest.raises(ValueError, match="stop: expected"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


# ---------------------------------------------------------------- EOS lists, special tokens


def first_new_token(tokens: list[int], start: int, avoid: tuple[int, ...]) -> int:
    """Index of the first token from `start` on that appears nowhere before it."""
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j] and tokens[j] not in avoid)


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_any_eos_of_either_file_stops_as_in_transformers(tmp_path, where):
    save_checkpoint(tmp_path)
    prompt = AutoTokenizer.from_pretrained(tmp_path).encode(PROMPTS[0])
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.inference_mode():
        free_run = hf_greedy(model, prompt, 24)
    j = first_new_token(free_run, 5, (EOS,))
    extra = free_run[j]
    if where == "config.json":  # a list in config.json, no generation_config.json
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [EOS, extra]}))
        (tmp_path / "generation_config.json").unlink()
    else:  # config.json keeps one EOS; the generation config lists two (as Llama-3-Instruct does)
        GenerationConfig(bos_token_id=0, eos_token_id=[EOS, extra]).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.inference_mode():
        expected = hf_greedy(model, prompt, 24)
    assert expected == free_run[: j + 1]  # transformers stops at the extra EOS
    with LLM(model=str(tmp_path), num_gpu_blocks=32) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    assert out.token_ids == expected and out.finish_reason == "stop"


def test_text_drops_special_tokens_by_default(tmp_path):
    save_checkpoint(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    prompt = tokenizer.encode(PROMPTS[3])
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.inference_mode():
        free_run = hf_greedy(model, prompt, 24)
        j = first_new_token(free_run, 4, (EOS, END))
        assert END not in free_run[:j]
        # swap the output rows of the special token and the j-th token: greedy emits it there
        head = model.lm_head.weight
        head[[END, free_run[j]]] = head[[free_run[j], END]].clone()
    model.save_pretrained(tmp_path)
    with LLM(model=str(tmp_path), num_gpu_blocks=32) as llm:
        plain = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
        assert plain.token_ids[j] == END and "<|end|>" not in plain.text
        raw_params = SamplingParams(max_tokens=24, temperature=0.0, skip_special_tokens=False)
        raw = llm.generate([prompt], raw_params, use_tqdm=False)[0]
    assert raw.token_ids == plain.token_ids and "<|end|>" in raw.text
    assert plain.text == raw.text.replace("<|end|>", "")


def test_the_eos_that_stops_a_request_is_not_in_its_text(llm):
    outs = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=24, temperature=0.0, skip_special_tokens=False),
                        use_tqdm=False)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == EOS
    assert "</s>" not in outs[0].text


# ---------------------------------------------------------------- chat


def test_chat_uses_the_template(llm):
    messages = [{"role": "system", "content": "the cache"}, {"role": "user", "content": "swap or recompute?"}]
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|assistant|>")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    chat = llm.chat(messages, params, use_tqdm=False)
    assert [o.token_ids for o in chat] == [llm.generate([ids], params, use_tqdm=False)[0].token_ids]
    both = llm.chat([messages, messages[1:]], params, use_tqdm=False)
    assert both[0].token_ids == chat[0].token_ids and len(both) == 2


def test_chat_without_a_template_says_so(tmp_path):
    save_checkpoint(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / name).unlink(missing_ok=True)
    with LLM(model=str(tmp_path), num_gpu_blocks=8) as llm, pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])

