"""AsyncLLM with the engine in a process of its own: the outputs of the in-process engine, field
for field; aborts free the request there; refusals and a dead engine reach the streams; the
server answers 503 once its engine process has died; closing leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.http_server import running_server
from tieredkv import AsyncLLM, EngineConfig, SamplingParams
from tieredkv.engine_core import NewRequest
from tieredkv.engine_core.process import ProcessCore
from tieredkv.outputs import RequestOutput

ENGINE = dict(block_size=4, num_gpu_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)
PROMPT = "The quick brown fox jumps over the lazy dog"
LONG = SamplingParams(max_tokens=180, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def child(chat_model_dir):
    allm = AsyncLLM(model=chat_model_dir, engine_process=True, **ENGINE)
    yield allm
    asyncio.run(allm.close())


@pytest.fixture(scope="module")
def in_thread(chat_model_dir):
    allm = AsyncLLM(model=chat_model_dir, **ENGINE)
    yield allm
    asyncio.run(allm.close())


def engine_processes() -> set[multiprocessing.Process]:
    return {p for p in multiprocessing.active_children() if p.name == "tieredkv-engine"}


def comparable(out: RequestOutput) -> tuple:
    """An output without its timestamps (they differ between two engines), its samples'
    logprobs those of their tokens so far (an engine in this process hands out its live list)."""
    m = out.metrics
    outputs = [dataclasses.replace(c, logprobs=c.logprobs and c.logprobs[:len(c.token_ids)]) for c in out.outputs]
    return dataclasses.replace(out, metrics=None, outputs=outputs), m.num_prompt_tokens, m.num_cached_tokens


async def stream_of(allm: AsyncLLM, params: SamplingParams) -> list[tuple]:
    return [comparable(out) async for out in allm.generate_stream(PROMPT, params, request_id="r")]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=10, logprobs=2),
    SamplingParams(n=2, best_of=4, seed=3, temperature=1.0, max_tokens=8),
], ids=["greedy", "n3-logprobs", "best_of"])
async def test_every_output_equals_the_in_process_engines(child, in_thread, params):
    expected = await stream_of(in_thread, params)
    got = await stream_of(child, params)
    assert got == expected
    assert len(got) > 1 and got[-1][0].finished and got[-1][0].text


async def test_abort_frees_the_request_in_the_engine_process(child):
    outputs = []
    async for out in child.generate_stream(list(range(5, 60)), LONG, request_id="long"):
        outputs.append(out)
        if len(out.token_ids) == 3:
            assert (await asyncio.to_thread(child.stats))["gpu_blocks_used"] > 0
            child.abort("long")
    assert outputs[-1].finish_reason == "abort" and outputs[-1].request_id == "long"
    async for out in child.generate_stream(list(range(5, 60)), LONG):  # leaving early aborts too
        if len(out.token_ids) == 2:
            break
    await child.drained()
    stats = await asyncio.to_thread(child.stats)
    assert stats["gpu_blocks_used"] == 0 and stats["requests_running"] == stats["requests_waiting"] == 0


async def test_a_bad_request_raises_the_engines_value_error(child, in_thread):
    too_long = SamplingParams(max_tokens=5000)
    with pytest.raises(ValueError) as expected:
        in_thread.engine.make_sequence([5, 6, 7], too_long)
    with pytest.raises(ValueError) as got:
        await child.generate([5, 6, 7], too_long)
    assert str(got.value) == str(expected.value)
    with pytest.raises(ValueError, match="prompt: is empty"):
        await child.generate([], too_long)


class Recorder:
    """An output sink that keeps what it is given."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.failed: list[tuple[str | None, BaseException]] = []

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self.outputs += outputs

    def fail(self, request_id: str | None, err: BaseException) -> None:
        self.failed.append((request_id, err))


async def test_a_refusal_in_the_engine_process_reaches_its_request_and_close_stops_it():
    before = engine_processes()
    sink = Recorder()
    core = ProcessCore(EngineConfig.from_kwargs(model="tiny-llama", **ENGINE), sink)
    [proc] = engine_processes() - before
    core.add(NewRequest("r#0", [5, 6, 7], SamplingParams(max_tokens=5000), time.monotonic()))  # past this side's checks
    await asyncio.wait_for(core.drained(), timeout=30)
    [(request_id, err)] = sink.failed
    assert request_id == "r#0" and type(err) is ValueError and str(err).startswith("prompt: 3 tokens + max_tokens")
    await asyncio.wait_for(core.close(), timeout=60)
    assert not proc.is_alive() and proc.exitcode == 0 and proc not in engine_processes()


async def test_sending_never_waits_for_the_engine_process_to_read(child):
    """A long prompt fills the pipe faster than the engine process reads it between two steps:
    the event loop hands requests to a sender thread and goes on delivering tokens. With the
    engine process stopped, requests far past the pipe's buffer are handed over at once, and all
    of them are served once it runs again."""
    proc = child._core._proc
    prompt = [300 + i % 80 for i in range(250)]  # ~0.8 KB pickled: 800 requests ~600 KB
    params = SamplingParams(max_tokens=1, temperature=0.0)
    os.kill(proc.pid, signal.SIGSTOP)
    watchdog = threading.Timer(5.0, os.kill, (proc.pid, signal.SIGCONT))  # a send that waits fails, not hangs
    watchdog.start()
    try:
        start = time.monotonic()
        streams = [child.generate_stream(prompt, params) for _ in range(800)]
        firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        await asyncio.sleep(0.2)  # each stream's generator ran up to its wait for a token
        assert time.monotonic() - start < 2.0 and not any(f.done() for f in firsts)
    finally:
        watchdog.cancel()
        os.kill(proc.pid, signal.SIGCONT)
    outs = [await first for first in firsts]
    assert all(out.finished and len(out.token_ids) == 1 for out in outs)


def test_a_dead_engine_process_ends_the_streams_and_the_server_answers_503(chat_model_dir, in_thread):
    before = engine_processes()
    with running_server(AsyncLLM(model=chat_model_dir, engine_process=True, **ENGINE), "m") as server:
        [proc] = engine_processes() - before
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "n": 2, "seed": 1, "temperature": 1.0,
                "return_token_ids": True}
        choices = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"]
        expected = asyncio.run(in_thread.generate(PROMPT, SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=6)))
        assert [c["token_ids"] for c in choices] == [c.token_ids for c in expected.outputs]
        long = {"model": "m", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(proc.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert rest[-1] == "data: [DONE]" and "the engine process exited" in error["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert "time_to_first_token" in httpx.get(f"{server.url}/metrics").text  # still served
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503 and "not running" in refused.json()["error"]["message"]
    assert proc not in engine_processes()


async def test_an_engine_process_starts_its_tensor_parallel_ranks(in_thread):
    """The engine process is not daemonic: it starts the ranks of `tensor_parallel_size: 2`
    itself, and their tokens are the one-rank engine's."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = await in_thread.generate(PROMPT, greedy)
    before = engine_processes()
    ranked = AsyncLLM(model=in_thread.info.config.model.model, engine_process=True, tensor_parallel_size=2, **ENGINE)
    try:
        got = await ranked.generate(PROMPT, greedy)
    finally:
        await ranked.close()
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert engine_processes() == before


async def test_a_cancelled_prefix_cache_reset_leaves_the_engine_serving(child):
    reset = asyncio.ensure_future(child.reset_prefix_cache())
    await asyncio.sleep(0)  # the call is sent; its reply comes to nobody
    reset.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reset
    out = await asyncio.wait_for(child.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0)), 30)
    assert out.finished and child.healthy


def test_close_on_another_event_loop_after_a_stream_left_early(chat_model_dir):
    allm = AsyncLLM(model=chat_model_dir, engine_process=True, **ENGINE)
    [proc] = [p for p in engine_processes() if p.pid == allm._core._proc.pid]

    async def leave_early() -> None:
        async for _ in allm.generate_stream(PROMPT, LONG):
            break

    asyncio.run(leave_early())  # that loop is closed with the request's last output on its way
    asyncio.run(asyncio.wait_for(allm.close(), 30))
    assert proc.exitcode == 0


def test_a_script_that_never_closes_its_engine_process_exits_promptly(chat_model_dir, tmp_path):
    script = tmp_path / "forgets_to_close.py"
    script.write_text(
        "import asyncio\n"
        "from tieredkv import AsyncLLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    allm = AsyncLLM(model={chat_model_dir!r}, engine_process=True, num_gpu_blocks=64)\n"
        "    asyncio.run(allm.generate('hello', SamplingParams(max_tokens=2)))\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert "did not stop" not in done.stderr and time.monotonic() - start < 25
