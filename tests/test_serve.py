"""`tieredkv serve`: the real server on a free loopback port, driven by the official `openai`
client and by raw HTTP (httpx): completions and chat, whole and streamed, equal to
`LLM.generate`; stop strings; usage; 400s naming the field; disconnects; engine failures;
200 concurrent streams; the command line."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.http_server import running_server
from tieredkv import LLM, AsyncLLM, SamplingParams
from tieredkv.cli import main

NAME = "tiny-chat"
PROMPTS = ["the cache block", "swap recompute prefix", "café naïve", "東京 über the", "a slow disk"]
MESSAGES = [{"role": "system", "content": "the cache"}, {"role": "user", "content": "swap or recompute?"}]
IGNORE_EOS = {"ignore_eos": True}  # vLLM's extension field, sent as the openai client sends extras
ENGINE = dict(block_size=16, num_gpu_blocks=512, max_num_seqs=256, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def server(chat_model_dir):
    with running_server(AsyncLLM(model=chat_model_dir, **ENGINE), NAME) as running:
        yield running


@pytest.fixture(scope="module")
def reference(chat_model_dir):
    with LLM(model=chat_model_dir, **ENGINE) as llm:
        yield llm


def greedy(max_tokens: int = 16, **params) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)


def sse_events(lines: list[str]) -> list[str]:
    """The data of each event; fails on anything but `data:` lines and blank separators."""
    assert all(line == "" or line.startswith("data: ") for line in lines), "no comments or pings"
    return [line[len("data: "):] for line in lines if line]


def assert_nothing_held(m: dict[str, float]) -> None:
    assert m["tieredkv_gpu_blocks_used"] == 0
    assert m["tieredkv_requests_running"] == m["tieredkv_requests_waiting"] == 0


# ---------------------------------------------------------------- the OpenAI API


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].model_extra["root"] == server.allm.engine.config.model.model
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_model_is_retrieved_by_name_and_probes_may_send_head(server):
    """`client.models.retrieve` (OpenAI's `GET /v1/models/{id}`): the served model's card, a 404
    naming `model` for any other; `HEAD /health` and `HEAD /v1/models`, as load balancers probe."""
    client = server.client()
    assert client.models.retrieve(NAME) == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["param"] == "model" and "'gpt-4' is not served here" in err.value.body["message"]
    for path in ("/health", "/v1/models"):
        response = httpx.head(f"{server.url}{path}")
        assert response.status_code == 200 and response.content == b""


def test_completions_equal_generate(server, reference):
    expected = reference.generate(PROMPTS, greedy(), use_tqdm=False)
    ids = reference.tokenizer.encode(PROMPTS[0])
    client = server.client()
    for prompt, want in [(PROMPTS[0], expected[0]), (ids, expected[0]), (PROMPTS[3], expected[3])]:
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids)
    batch = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in batch.choices] == [o.text for o in expected]
    assert batch.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_streamed_completion_is_one_token_per_chunk(server, reference):
    want = reference.generate(PROMPTS[1], greedy(12, ignore_eos=True), use_tqdm=False)[0]
    client = server.client()
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            extra_body=IGNORE_EOS, stream=True, stream_options={"include_usage": True}))
    *tokens, usage = chunks
    assert len(tokens) == 12 and "".join(c.choices[0].text for c in tokens) == want.text
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 11 + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.usage.prompt_tokens == len(want.prompt_token_ids)
    plain = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                           extra_body=IGNORE_EOS, stream=True))
    assert len(plain) == 12 and all(c.usage is None for c in plain)  # usage only when asked


def test_raw_stream_is_data_lines_and_done(server):
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]" and len(events) == 6
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_chat_equals_llm_chat(server, reference):
    want = reference.chat(MESSAGES, greedy(10), use_tqdm=False)[0]
    client = server.client()
    got = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert len(chunks) == len(want.token_ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    # content as a list of text parts (as vllm bench sends it) is the same message
    content = [{"type": "text", "text": "swap or "}, {"type": "text", "text": "recompute?"}]
    parts = [{"role": "user", "content": content}]
    same = client.chat.completions.create(model=NAME, messages=[MESSAGES[0], *parts], max_tokens=10, temperature=0)
    assert same.choices[0].message.content == want.text


def test_stop_strings(server, reference):
    full = reference.generate(PROMPTS[0], greedy(24, ignore_eos=True), use_tqdm=False)[0].text
    stop = full[8:11]
    client = server.client()
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                    extra_body=IGNORE_EOS, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < 24
    streamed = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                         extra_body=IGNORE_EOS, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_tokenize_and_detokenize(server, reference):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[3]}).json()
    assert tokens["tokens"] == reference.tokenizer.encode(PROMPTS[3]) and tokens["count"] == len(tokens["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == reference.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                    return_dict=False)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPTS[3]}
    for bad in ([1, 2.5], [1, "x"], [10**6]):
        error = httpx.post(f"{server.url}/detokenize", json={"tokens": bad})
        assert error.status_code == 400 and error.json()["error"]["param"] == "tokens"


def test_detokenize_decodes_off_the_event_loop(server, monkeypatch):
    """Decoding a long list of tokens would hold up every stream the event loop sends."""
    tokenizer, on_loop = server.allm.tokenizer, []
    decode = tokenizer.decode

    def spy(*args, **kwargs):
        try:
            on_loop.append(asyncio.get_running_loop() is not None)
        except RuntimeError:  # no loop runs in this thread
            on_loop.append(False)
        return decode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", spy)
    response = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenizer.encode(PROMPTS[3])})
    assert response.json() == {"prompt": PROMPTS[3]} and on_loop == [False]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 256}, "max_tokens"),  # the prompt fits, but not with 256 more tokens
    ({"prompt": "the cache " * 200}, "prompt"),  # longer than the model's 256 positions
    ({"prompt": [5, 6.5, 7]}, "prompt"),
    ({"prompt": [[5, 6], [7, "8"]]}, "prompt"),
    ({"prompt": [5, 10**6]}, "prompt"),  # not in the vocabulary
    ({"model": "gpt-4"}, "model"),
    ({"temperature": -1}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"echo": True, "logprobs": 1}, "echo"),
])
def test_bad_completion_is_400_naming_the_field(server, kwargs, param):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**{"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, **kwargs})
    assert err.value.status_code == 400 and err.value.param == param
    assert err.value.body["type"] == "BadRequestError" and param in err.value.body["message"]
    ok = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MESSAGES, "max_tokens": -5, "max_completion_tokens": 2}, "max_tokens"),  # not ignored
    ({"messages": [{"role": "user", "content": "the cache " * 200}]}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": MESSAGES, "model": "other"}, "model"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": MESSAGES, "echo": True}, "echo"),
])
def test_bad_chat_is_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_unknown_fields_are_ignored(server):
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 3, "repetition_penalty": 1.0, "logprobs": None,
            "some_future_field": {"x": 1}, "user": "me"}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200


def test_client_leaving_mid_stream_aborts_and_frees_its_blocks(server):
    before = server.settled()
    body = {"model": NAME, "prompt": PROMPTS[4] * 3, "temperature": 0, "ignore_eos": True, "stream": True,
            "max_tokens": 240}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert len(got) == 3
        during = server.metrics()
        assert during["tieredkv_gpu_blocks_used"] > 0 and during["tieredkv_requests_running"] == 1
    after = server.settled()
    assert_nothing_held(after)
    # it was aborted: it never finished in the engine, and it counts as an abort
    assert after["tieredkv_requests_finished"] == before["tieredkv_requests_finished"]
    aborts = 'tieredkv_requests_total{outcome="abort"}'
    assert after[aborts] == before.get(aborts, 0) + 1


def test_client_leaving_a_whole_response_aborts_it(server):
    before = server.settled()
    body = {"model": NAME, "prompt": PROMPTS[4] * 3, "temperature": 0, "ignore_eos": True, "max_tokens": 240}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 240 tokens
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.1)
    after = server.settled()
    assert_nothing_held(after)
    assert after["tieredkv_requests_finished"] == before["tieredkv_requests_finished"]


def test_engine_failure_is_500_and_the_server_keeps_serving(server, monkeypatch):
    runner = server.allm.engine.runner
    real = runner.execute
    failures = []

    def fail_once(*args):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected device fault")
        return real(*args)

    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    monkeypatch.setattr(runner, "execute", fail_once)
    whole = httpx.post(f"{server.url}/v1/completions", json=body)
    assert whole.status_code == 500 and "injected device fault" in whole.json()["error"]["message"]
    failures.clear()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
        events = sse_events(list(response.iter_lines()))
    assert json.loads(events[0])["error"]["code"] == 500 and events[-1] == "[DONE]"
    ok = httpx.post(f"{server.url}/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert_nothing_held(server.settled())


async def test_200_concurrent_streams_complete_in_order(server, reference):
    prompts = [f"{PROMPTS[i % 5]} {'tier' * (i % 7)}" for i in range(200)]
    expected = {p: o.text for p, o in zip(prompts, reference.generate(
        prompts, greedy(6, ignore_eos=True), use_tqdm=False), strict=True)}
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, list[str]]:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = sse_events([line async for line in response.aiter_lines()])
        return prompt, events

    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        results = await asyncio.gather(*(one(client, p) for p in prompts))
    for prompt, events in results:
        assert events[-1] == "[DONE]" and len(events) == 7
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == expected[prompt]
        assert [c["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert_nothing_held(server.settled())


# ---------------------------------------------------------------- the command line


def cli_serve(*args: str) -> list[str]:
    """The command line of `tieredkv serve ARGS` on a free port."""
    return [sys.executable, "-m", "tieredkv.cli", "serve", *args, "--port", "0"]


def lines_until_serving(proc: subprocess.Popen) -> list[str]:
    """What the server printed up to its "serving ... at URL" line."""
    lines = []
    while not lines or not lines[-1].startswith("serving"):
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
    return lines


def test_cli_serve_prints_the_tiers_then_the_url(chat_model_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: tiny-llama\ncache: {num_gpu_blocks: 32, block_size: 8}\n"
                      "scheduler: {preemption: recompute}\nworkload: {kind: multi_turn}\n")
    proc = subprocess.Popen(cli_serve(str(config), "--model", chat_model_dir, "--served-model-name", NAME),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = lines_until_serving(proc)
        report = "".join(lines)
        assert re.search(r"GPU tier +32 blocks x 8 tokens = 256 tokens", report)
        assert "CPU tier     none" in report and "cost model" in report and "I/O backend" in report
        url = re.search(r"at (http://\S+)/v1", lines[-1]).group(1)
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == NAME and models["data"][0]["root"] == chat_model_dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_serve_stops_on_ctrl_c_without_a_traceback():
    """Ctrl-C (SIGINT to the terminal's process group: the server and its engine process) shuts
    the server down and exits 130, as `tieredkv run` does."""
    proc = subprocess.Popen(cli_serve("demo"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        lines = lines_until_serving(proc)
        url = re.search(r"at (http://\S+)/v1", lines[-1]).group(1)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in rest, rest


def test_cli_serve_needs_a_model(capsys):
    assert main(["serve"]) == 2
    assert "tieredkv: error: serve: give a CONFIG.yaml, --model, or both" in capsys.readouterr().err


def test_cli_serve_reads_the_config_as_from_yaml(tmp_path, monkeypatch):
    """Paths are taken from the config's folder, `${results}` is a folder of the server's own
    (removed when it stops), and a shipped config is found by name, as `tieredkv run` finds it."""
    served = []

    def serve(config, *args, **kwargs):
        path = config.cache.nvme_path
        served.append((config.model.model, path, os.path.isdir(os.path.dirname(path))))

    monkeypatch.setattr("tieredkv.serve.server.serve", serve)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp").mkdir()
    for name, store in (("results", "'${results}/nvme'"), ("store", "store")):
        (tmp_path / "exp" / f"{name}.yaml").write_text(
            f"model: tiny-llama\ncache: {{nvme_path: {store}, nvme_bytes: 1MiB, cpu_cache_bytes: 64KiB}}\n")
    for config in ("exp/results.yaml", "exp/store.yaml", "demo"):
        assert main(["serve", config]) == 0
    (_, scratch, existed), store, (model, demo_store, _) = served
    assert existed and scratch.endswith("/nvme") and not scratch.startswith(str(tmp_path))
    assert not os.path.exists(os.path.dirname(scratch))  # removed when the server stopped
    assert store == ("tiny-llama", str(tmp_path / "exp" / "store"), True)
    assert model == "tiny-llama" and demo_store.endswith("/nvme") and not os.path.exists(os.path.dirname(demo_store))
    assert os.listdir(tmp_path) == ["exp"]  # no `${results}` folder in the working directory
