"""More adversarial requests against the real server (on a free loopback port): fields the engine
would otherwise ignore in silence (stop strings where there is no tokenizer, an empty stop
string, a request's own chat template), the chat template options it takes (as transformers
applies them), a field name that is not valid Unicode, a batch of prompts
with a field neither API has (one warning, not one a prompt), a request the engine fails
alone (a 500 with its message, not a 200 with `finish_reason: "error"`), and a bad prompt in a
batch (named by its index). Each is refused with a
400 naming what to fix, and afterwards the server still serves the good request with the tokens
it got at the start, holding nothing."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.http_server import running_server
from tests.test_adversarial_http import ENGINE, GOOD, JSON, MESSAGES, NAME, assert_still_serving, good_tokens, refused
from tieredkv import AsyncLLM

IDS = [5, 17, 99, 4, 250, 31, 8, 77]  # a token-id prompt for the preset


@pytest.fixture(scope="module")
def server(chat_model_dir):
    with running_server(AsyncLLM(model=chat_model_dir, **ENGINE), NAME) as running:
        yield running


@pytest.fixture(scope="module")
def baseline(server) -> list[int]:
    return good_tokens(server)


@pytest.fixture(scope="module")
def preset_server():
    """A model with no tokenizer: its text is token ids ("token_id:N")."""
    with running_server(AsyncLLM(model="tiny-llama", **ENGINE), "tiny-llama") as running:
        yield running


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("stop", ["token_id:5", ["x", "token_id:128"]])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_without_a_tokenizer_are_400(preset_server, stop, stream):
    """Without a tokenizer there is no text to find a stop string in: the request is refused
    (pointing at stop_token_ids), not run as if it had no stop."""
    body = {"model": "tiny-llama", "prompt": IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    error = refused(httpx.post(f"{preset_server.url}/v1/completions", json={**body, "stop": stop, "stream": stream}))
    assert error["param"] == "stop" and "tokenizer" in error["message"] and "stop_token_ids" in error["message"]
    ok = httpx.post(f"{preset_server.url}/v1/completions", json={**body, "stop": None, "stop_token_ids": [IDS[0]]})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) >= 1
    m = preset_server.settled()
    assert m["tieredkv_requests_running"] == m["tieredkv_requests_waiting"] == m["tieredkv_gpu_blocks_used"] == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", GOOD), ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
])
def test_an_empty_stop_string_is_400_as_in_a_list(server, baseline, path, body):
    """`stop: ""` is refused as `stop: [""]` is (it used to be read as no stop at all)."""
    for stop in ("", [""]):
        error = refused(httpx.post(f"{server.url}{path}", json={**body, "stop": stop}))
        assert error["param"] == "stop" and "non-empty" in error["message"]
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- a bad prompt in a batch


@pytest.mark.parametrize("body, message", [
    ('{"model": "tiny-chat", "prompt": [[5, 6], [7, 1000000], [8]]}', "prompt[1]: token ids must be integers"),
    ('{"model": "tiny-chat", "prompt": ["the cache", "swap", "the \\udc00 tier"]}', "prompt[2]: has a lone surrogate"),
    ('{"model": "tiny-chat", "prompt": ["the cache", ""]}', "prompt[1]: is empty"),
    (json.dumps({"model": NAME, "prompt": [[5], [5] + [6] * 300]}), "prompt[1]: 301 tokens leave no room"),
], ids=["vocabulary", "surrogate", "empty", "too-long"])
def test_a_bad_prompt_in_a_batch_is_named_by_its_index(server, baseline, body, message):
    """In a batch the error says which prompt to fix (the param stays `prompt`)."""
    error = refused(httpx.post(f"{server.url}/v1/completions", content=body.encode(), headers=JSON))
    assert error["param"] == "prompt" and error["message"].startswith(message), error
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- chat template options


def test_a_request_chat_template_is_400(server, baseline):
    """Only the model's own template renders chat (a request's would be code run on the server);
    its neutral value changes nothing."""
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    for path in ("/v1/chat/completions", "/tokenize"):
        error = refused(httpx.post(f"{server.url}{path}", json={**body, "chat_template": "{{ 'x' }}"}))
        assert error["param"] == "chat_template" and error["message"].startswith("chat_template: not supported")
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
    same = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "chat_template": None}).json()
    assert same["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("options", [
    {}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True},
    {"chat_template_kwargs": {"enable_thinking": False}},
])
def test_chat_template_options_shape_the_prompt_as_in_transformers(server, baseline, chat_model_dir, options):
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the model's
    template: /tokenize and chat's prompt are transformers' `apply_chat_template` with them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    kwargs = {"add_generation_prompt": True, **options}
    expected = tokenizer.apply_chat_template(MESSAGES, return_dict=False, **kwargs.pop("chat_template_kwargs", {}),
                                             **kwargs)
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, **options}).json()["tokens"]
    assert tokens == expected
    chat = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0, **options}).json()
    assert chat["usage"]["prompt_tokens"] == len(expected)
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("options, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default add_generation_prompt
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_contradictory_chat_template_options_are_400(server, baseline, options, param):
    """A new turn opened after a message left open, the tokenizer's own arguments passed as
    template variables, or a wrong type: a 400 naming the field, on both endpoints."""
    for path in ("/v1/chat/completions", "/tokenize"):
        error = refused(httpx.post(f"{server.url}{path}", json={"messages": MESSAGES, "max_tokens": 2, **options}))
        assert error["param"] == param, error
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- field names


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"model": "tiny-chat", "prompt": "a", "max_tokens": 2, "\\ud800x": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}'),
])
def test_a_field_name_with_a_lone_surrogate_is_400_saying_so(server, baseline, path, body):
    """The body is a JSON object: the error says its field name is not valid Unicode."""
    error = refused(httpx.post(f"{server.url}{path}", content=body.encode(), headers=JSON))
    assert error["param"] is None and "lone surrogate" in error["message"], error
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- unknown fields


def test_an_unknown_field_is_logged_once_for_a_batch_of_prompts(server, baseline, caplog):
    """A request's ignored fields are one warning in the log, however many prompts it holds."""
    body = {**GOOD, "prompt": [[5, 6]] * 50, "max_tokens": 1, "some_future_field": 1}
    with caplog.at_level(logging.WARNING, logger="tieredkv.serve.protocol"):
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == 50
    warnings = [r.getMessage() for r in caplog.records if r.name == "tieredkv.serve.protocol"]
    assert warnings == ["ignored fields neither OpenAI's nor vLLM's API has: some_future_field"]
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- requests the engine fails


@pytest.mark.parametrize("extra", [{}, {"n": 3}, {"prompt": [[5, 6], [7, 8]]}], ids=["one", "n", "batch"])
def test_a_request_the_sampler_cannot_sample_is_500_with_its_message(server, baseline, extra):
    """Every token banned (all of them stop tokens, before min_tokens): the engine fails the
    request, and the client gets that error, whole or streamed, not an empty 200."""
    vocab = server.allm.info.limits.vocab_size
    body = {**GOOD, "temperature": 1.0, "min_tokens": 1, "stop_token_ids": list(range(vocab)), **extra}
    whole = httpx.post(f"{server.url}/v1/completions", json=body)
    assert whole.status_code == 500, whole.text
    error = whole.json()["error"]
    assert error["type"] == "InternalServerError" and "sampling: the next-token probabilities" in error["message"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line]
    assert [json.loads(e)["error"]["code"] for e in events[:-1]] == [500] and events[-1] == "[DONE]"
    assert "sampling: the next-token probabilities" in json.loads(events[0])["error"]["message"]
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- add_special_tokens


@pytest.fixture(scope="module")
def bos_server(chat_model_dir, tmp_path_factory):
    """The chat model with a tokenizer that puts BOS before every encoded text."""
    import shutil

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("bos-model")
    shutil.copytree(chat_model_dir, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save_pretrained(path)
    with running_server(AsyncLLM(model=str(path), **ENGINE), NAME) as running:
        yield running, bos


def test_add_special_tokens_decides_whether_a_completion_prompt_starts_with_bos(bos_server):
    """A completion's text is encoded with the tokenizer's special tokens unless
    `add_special_tokens: false` (vLLM's field); in chat the template places them, so only false
    (its neutral value) is taken there."""
    server, bos = bos_server
    body = {"model": NAME, "prompt": "the cache block", "max_tokens": 1, "temperature": 0}
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
    assert tokens[0] == bos
    on = httpx.post(f"{server.url}/v1/completions", json=body).json()
    off = httpx.post(f"{server.url}/v1/completions", json={**body, "add_special_tokens": False}).json()
    assert on["usage"]["prompt_tokens"] == len(tokens) == off["usage"]["prompt_tokens"] + 1
    chat = {"messages": MESSAGES, "max_tokens": 1}
    url = f"{server.url}/v1/chat/completions"
    assert httpx.post(url, json={**chat, "add_special_tokens": False}).status_code == 200
    error = refused(httpx.post(url, json={**chat, "add_special_tokens": True}))
    assert error["param"] == "add_special_tokens"


# ---------------------------------------------------------------- continuous usage


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**GOOD, "prompt": ["the cache block", "swap tier"], "n": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_continuous_usage_stats_put_each_prompts_counts_so_far_in_every_chunk(server, baseline, path, body):
    """`stream_options.continuous_usage_stats` (vLLM's, with `include_usage`): every chunk
    carries its prompt's token counts so far; the last chunk the whole request's. It used to
    be ignored."""
    body = {**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}{path}", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    *chunks, last = events
    n = body.get("n", 1)
    seen: dict[int, int] = {}  # choice -> tokens sent so far
    counted: dict[int, int] = {}  # prompt -> completion tokens its chunks said so far
    for c in chunks:
        [choice] = c["choices"]
        seen[choice["index"]] = seen.get(choice["index"], 0) + 1
        prompt, count = choice["index"] // n, c["usage"]["completion_tokens"]
        # its n choices' tokens so far: those sent, and those of the same step not sent yet
        assert sum(seen.get(prompt * n + j, 0) for j in range(n)) <= count <= 4 * n
        assert count >= counted.get(prompt, 0) and c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + count
        counted[prompt] = count
    assert set(counted.values()) == {4 * n}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(seen.values()) == 4 * len(seen)
    plain = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}{path}", json=plain) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert all("usage" not in c for c in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 4 * len(seen)
    assert_still_serving(server, baseline)
