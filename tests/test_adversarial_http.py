"""Adversarial requests against the real server (one per module, on a free loopback port): bodies
that are not JSON objects, too large, of the wrong types, long lists of bad items, with lone
surrogates, chat messages the engine cannot take, too many prompts, clients that leave. Each is
refused with an OpenAI error object (a 400 naming the field, or a 413), and afterwards the server
still serves the good request made at the start with the same tokens, holding nothing."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pydantic
import pytest

from tests.http_server import running_server
from tieredkv import AsyncLLM
from tieredkv.serve.app import MAX_BODY_BYTES
from tieredkv.serve.protocol import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from tieredkv.text import chars_per_token

NAME = "tiny-chat"
ENGINE = dict(block_size=16, num_gpu_blocks=128, max_num_seqs=32, max_num_batched_tokens=256)
GOOD = {"model": NAME, "prompt": "the cache block", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "swap or recompute?"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(chat_model_dir):
    with running_server(AsyncLLM(model=chat_model_dir, **ENGINE), NAME) as running:
        yield running


@pytest.fixture(scope="module")
def baseline(server) -> list[int]:
    """The good request's tokens, before any bad request."""
    return good_tokens(server)


def good_tokens(server) -> list[int]:
    response = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def assert_still_serving(server, baseline: list[int]) -> None:
    """The good request gets the tokens it got at the start, and nothing is left running."""
    assert good_tokens(server) == baseline
    m = server.settled()
    assert m["tieredkv_requests_running"] == m["tieredkv_requests_waiting"] == m["tieredkv_gpu_blocks_used"] == 0


def refused(response: httpx.Response, status: int = 400) -> dict:
    """The OpenAI error object of a refused request."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == ("BadRequestError" if status == 400 else error["type"])
    return error


# ---------------------------------------------------------------- bodies


@pytest.mark.parametrize("content, headers, message", [
    (b"{bad", JSON, "body: not valid JSON"),
    (b'{"model": "tiny-chat", "prompt": "a\xff\xfe"}', JSON, "body: not valid JSON"),
    (b"", JSON, "body: expected a JSON object"),
    (b"[1, 2]", JSON, "body: expected a JSON object"),
    (b'"the cache"', JSON, "body: expected a JSON object"),
    (json.dumps(GOOD).encode(), {"content-type": "text/plain"}, "body: expected a JSON object"),
], ids=["malformed", "not-utf8", "empty", "list", "string", "text-plain"])
def test_a_body_that_is_not_a_json_object_is_400(server, baseline, content, headers, message):
    error = refused(httpx.post(f"{server.url}/v1/completions", content=content, headers=headers))
    assert error["param"] is None and error["message"].startswith(message)
    assert_still_serving(server, baseline)


def test_a_body_over_the_limit_is_413_without_reading_it(server, baseline):
    started = time.monotonic()
    body = {**GOOD, "prompt": "the cache " * (MAX_BODY_BYTES // 10)}
    error = refused(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60), 413)
    assert f"{MAX_BODY_BYTES} bytes" in error["message"]
    assert time.monotonic() - started < 10  # tokenizing it would take minutes
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- types and values


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.0), ("temperature", "0"), ("temperature", True),
    ("top_p", "1"), ("top_k", True), ("n", True), ("n", "1"), ("logprobs", True), ("seed", "3"), ("best_of", True),
    ("min_tokens", "1"), ("echo", "yes"), ("ignore_eos", "yes"), ("ignore_eos", 1), ("stream", "true"),
    ("skip_special_tokens", "no"), ("stop_token_ids", ["5"]), ("model", 5), ("stream_options", {"include_usage": 1}),
])
def test_a_value_of_the_wrong_type_is_400_naming_it(server, baseline, field, value):
    error = refused(httpx.post(f"{server.url}/v1/completions", json={**GOOD, field: value}))
    assert error["param"] == field and error["message"].startswith(field)
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("field, value, message", [
    ("stop", 5, "stop: Input should be a valid string"),
    ("stop", ["end", 5], "stop[1]: Input should be a valid string"),
    ("prompt", 5, "prompt: expected a string, a list of token ids (integers), or a list of either; "
                  "prompt: Input should be a valid string"),
])
def test_a_union_field_at_fault_is_named_without_its_type_tags(server, baseline, field, value, message):
    """The error names the place in the body, not pydantic's tag of a union's branch ("stop.str")."""
    error = refused(httpx.post(f"{server.url}/v1/completions", json={**GOOD, field: value}))
    assert error["param"] == field and error["message"] == message
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("path, field, value, neutral", [
    ("/v1/completions", "repetition_penalty", True, 1), ("/v1/completions", "length_penalty", True, 1),
    ("/v1/completions", "frequency_penalty", False, 0), ("/v1/completions", "min_p", False, 0),
    ("/v1/completions", "use_beam_search", 0, False), ("/v1/completions", "include_stop_str_in_output", 0, False),
    ("/v1/chat/completions", "echo", 0, False), ("/v1/chat/completions", "add_special_tokens", 0, False),
])
def test_a_refused_field_is_neutral_only_of_its_type(server, baseline, path, field, value, neutral):
    """A field the engine does not do is accepted at its neutral value only: `true` is not
    `1.0` (Python's `==` says it is), `0` is not `false`; an integer stands for a float."""
    body = GOOD if path == "/v1/completions" else {"messages": MESSAGES, "max_tokens": 4}
    error = refused(httpx.post(f"{server.url}{path}", json={**body, field: value}))
    assert error["param"] == field and error["message"].startswith(f"{field}: not supported")
    assert httpx.post(f"{server.url}{path}", json={**body, field: neutral}).status_code == 200
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("field, value, message", [
    ("stop", [f"{i:040d}" for i in range(20_000)], "stop: at most 256 strings"),
    ("stop_token_ids", list(range(100_000)), "stop_token_ids: at most 1024 token ids"),
])
def test_stop_conditions_past_the_bound_are_400(server, baseline, field, value, message):
    """Checked at every token of every sample, a request's stop conditions are bounded: such a
    request (under the body limit) used to slow every other request ~200x while it ran."""
    error = refused(httpx.post(f"{server.url}/v1/completions", json={**GOOD, "n": 4, field: value}))
    assert error["param"] == field and error["message"].startswith(message)
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}),
])
def test_stream_options_without_stream_is_400(server, baseline, path, body):
    error = refused(httpx.post(f"{server.url}{path}", json=body))
    assert error["param"] == "stream_options" and "stream" in error["message"]
    assert_still_serving(server, baseline)


def test_too_many_prompts_is_400_naming_the_prompt(server, baseline):
    error = refused(httpx.post(f"{server.url}/v1/completions", json={**GOOD, "prompt": [[5, 6]] * (MAX_PROMPTS + 1)}))
    assert error["param"] == "prompt" and f"at most {MAX_PROMPTS}" in error["message"]
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("path, request_type, field, value", [
    ("/v1/completions", CompletionRequest, "prompt", [1] * 200_000 + ["x"]),
    ("/v1/completions", CompletionRequest, "stop", [1] * 200_000),
    ("/v1/completions", CompletionRequest, "stop_token_ids", ["x"] * 200_000),
    ("/v1/chat/completions", ChatCompletionRequest, "messages", [1] * 200_000),
    ("/detokenize", DetokenizeRequest, "tokens", ["x"] * 200_000),
])
def test_a_long_list_of_bad_items_is_400_at_its_first(server, baseline, path, request_type, field, value):
    """Validation stops at a list's first bad item: pydantic used to record an error for every
    bad item in every branch of a union, and a body of millions of them (under the body limit)
    held the event loop for a minute."""
    body = {"prompt": "the cache", "messages": MESSAGES, "tokens": [5], field: value}
    with pytest.raises(pydantic.ValidationError) as err:
        request_type.model_validate(body)
    assert err.value.error_count() <= 4  # one a branch of the field's union
    error = refused(httpx.post(f"{server.url}{path}", json=body))
    assert error["param"] == field and error["message"].startswith(field)
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"model": "tiny-chat", "prompt": "the \\ud800 cache", "max_tokens": 4}'),
    ("/v1/completions", '{"model": "tiny-chat", "prompt": ["the", "cache \\udfff"], "max_tokens": 4}'),
    ("/tokenize", '{"prompt": "the \\ud800 cache"}'),
], ids=["prompt", "batch", "tokenize"])
def test_a_lone_surrogate_in_a_prompt_is_400(server, baseline, path, body):
    error = refused(httpx.post(f"{server.url}{path}", content=body.encode(), headers=JSON))
    assert error["param"] == "prompt" and "lone surrogate" in error["message"]
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("stop", ['"\\ud800"', '["end", "stop \\udfff"]'], ids=["string", "list"])
def test_a_lone_surrogate_in_a_stop_string_is_400(server, baseline, stop):
    """A stop string no text can contain would never stop the request: refused, as in a prompt."""
    body = f'{{"model": "tiny-chat", "prompt": "the cache", "max_tokens": 4, "stop": {stop}}}'
    error = refused(httpx.post(f"{server.url}/v1/completions", content=body.encode(), headers=JSON))
    assert error["param"] == "stop" and "lone surrogate" in error["message"]
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("messages, message", [
    ('[{"role": "user", "content": "a \\udc00"}]', "messages[0].content: has a lone surrogate"),
    ('[{"role": "wizard", "content": "hi"}]', "messages[0].role: expected one of"),
    ('[{"role": "tool", "content": "42", "tool_call_id": "1"}]', "messages[0].role: 'tool' is not supported"),
    ('[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "1"}]}]',
     "messages[1].tool_calls: not supported"),
    ('[{"role": "user"}]', "messages[0].content: missing"),
    ('[{"role": "user", "content": [{"type": "text", "text": 5}]}]', "messages[0].content[0].text: expected a string"),
    ('[{"role": "user", "content": [{"type": "text"}]}]', "messages[0].content[0].text: expected a string"),
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
     "messages[0].content[0]: only text parts are supported"),
], ids=["surrogate", "unknown-role", "tool-role", "tool-calls", "no-content", "int-text", "no-text", "image"])
def test_chat_messages_the_engine_cannot_take_are_400(server, baseline, messages, message):
    body = f'{{"messages": {messages}, "max_tokens": 4}}'.encode()
    for path in ("/v1/chat/completions", "/tokenize"):
        error = refused(httpx.post(f"{server.url}{path}", content=body, headers=JSON))
        assert error["param"] == "messages" and error["message"].startswith(message), error
    assert_still_serving(server, baseline)


def test_chat_content_parts_are_the_text_they_hold(server):
    """/tokenize and chat read a list of text parts as its text joined (not as the list's repr)."""
    plain = [{"role": "user", "content": "swap or recompute?"}]
    text = [{"type": "text", "text": "swap or "}, {"type": "text", "text": "recompute?"}]
    parts = [{"role": "user", "content": text}]
    ids = [httpx.post(f"{server.url}/tokenize", json={"messages": m}).json()["tokens"] for m in (plain, parts)]
    assert ids[0] == ids[1]
    body = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
    replies = [httpx.post(f"{server.url}/v1/chat/completions", json={**body, "messages": m}).json()
               for m in (plain, parts)]
    assert replies[0]["choices"][0]["token_ids"] == replies[1]["choices"][0]["token_ids"]


def test_a_long_prompt_being_tokenized_does_not_stall_other_requests(server, baseline):
    """Tokenizing runs off the event loop: a short request is answered while a long prompt is
    still being tokenized (at /tokenize, which counts any text; a completion refuses one that
    long as it arrives)."""
    done: dict[str, float] = {}

    def long_prompt() -> None:
        response = httpx.post(f"{server.url}/tokenize", json={"prompt": "the cache " * 300_000}, timeout=120)
        done["long"] = time.monotonic()
        assert response.status_code == 200

    thread = threading.Thread(target=long_prompt)
    thread.start()
    time.sleep(0.3)  # its body is sent and tokenizing has started
    assert good_tokens(server) == baseline
    done["short"] = time.monotonic()
    thread.join(timeout=120)
    assert done["short"] < done["long"]


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {**GOOD, "prompt": "the cache " * 600}, "prompt: 6000 characters"),
    ("/v1/completions", {**GOOD, "prompt": ["the cache " * 600, "swap"]}, "prompt[0]: 6000 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the cache " * 600}]}, "messages: 60"),
], ids=["prompt", "batch", "messages"])
def test_a_text_too_long_for_any_request_is_400_without_tokenizing_it(server, baseline, monkeypatch, path, body,
                                                                     message):
    """A text with more characters than the longest request's tokens can stand for is refused
    as it arrives: tokenized first (to be refused then), a few long ones held the worker threads
    for seconds and every other request waited. No token stands for more characters than the
    bound allows, so no text that fits is refused."""
    tokenizer = server.allm.tokenizer
    assert max(len(tokenizer.decode([i])) for i in range(len(tokenizer))) <= chars_per_token(tokenizer)

    def encode(*args, **kwargs):
        raise AssertionError("the text was tokenized")

    monkeypatch.setattr(tokenizer, "encode", encode)
    error = refused(httpx.post(f"{server.url}{path}", json=body))
    assert error["message"].startswith(message) and "maximum length of 256 tokens" in error["message"]
    monkeypatch.undo()
    assert_still_serving(server, baseline)


# ---------------------------------------------------------------- clients that leave


async def test_streams_left_midway_are_aborted_and_the_rest_complete(server, baseline):
    whole = httpx.post(f"{server.url}/v1/completions", json={**GOOD, "max_tokens": 24, "n": 2, "seed": 7,
                                                              "temperature": 1.0}).json()
    expected = [c["text"] for c in whole["choices"]]

    async def one(client: httpx.AsyncClient, leave: bool) -> list[str] | None:
        body = {**GOOD, "max_tokens": 24, "n": 2, "seed": 7, "temperature": 1.0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            texts, events = ["", ""], 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                if leave and events == 3:
                    return None
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
            return texts

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as client:
        results = await asyncio.gather(*(one(client, i % 2 == 1) for i in range(24)))
    assert [r for r in results if r is not None] == [expected] * 12
    assert_still_serving(server, baseline)
