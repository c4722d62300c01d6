"""Shared fixtures: reference outputs from transformers `generate`; every test fails if the NVMe
store met an internal error (a bug it books apart from disk faults), unless marked
`allow_internal_errors`; a GPU test fails if it leaves a CUDA error behind."""

from __future__ import annotations

import ctypes
import functools
import gc
import logging

import pytest
import torch

from tests.reference import hf_greedy
from tieredkv.model.presets import build_preset


@pytest.fixture(scope="session")
def reference_outputs():
    """`reference_outputs(preset, prompts, n)`: greedy tokens of the float32 preset model, cached."""
    cache: dict[tuple, list[list[int]]] = {}

    def get(preset: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        key = (preset, tuple(map(tuple, prompts)), max_new_tokens)
        if key not in cache:
            model = build_preset(preset, seed=0)
            with torch.inference_mode():
                cache[key] = [hf_greedy(model, p, max_new_tokens) for p in prompts]
        return cache[key]

    return get


class _InternalErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "internal error" in record.getMessage():
            self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def fail_on_internal_errors(request):
    handler = _InternalErrors()
    logger = logging.getLogger("tieredkv.tiers.nvme")
    logger.addHandler(handler)
    yield
    logger.removeHandler(handler)
    if handler.messages and request.node.get_closest_marker("allow_internal_errors") is None:
        pytest.fail(f"the NVMe store met internal errors: {handler.messages[:3]}")


@functools.cache
def _cuda_runtimes() -> tuple[ctypes.CDLL, ...]:
    """The CUDA runtime libraries loaded in the process (torch's; another library may bring its
    own, with its own last error)."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    runtimes = tuple(ctypes.CDLL(path) for path in paths)
    for runtime in runtimes:
        runtime.cudaGetErrorString.restype = ctypes.c_char_p
    return runtimes


@pytest.fixture(autouse=True)
def fail_on_cuda_errors_left(request):
    """A GPU test fails if, once its objects are collected and its work is done, a CUDA
    runtime holds an error nobody read (`cudaGetLastError`, which also clears it). Such an error
    is not sticky: it would surface at the next torch call that checks, in another test."""
    yield
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.synchronize()
    left = [(r, r.cudaGetLastError()) for r in _cuda_runtimes()]
    errors = [f"{error} ({r.cudaGetErrorString(error).decode()}) in {r._name}" for r, error in left if error]
    if errors:
        pytest.fail(f"the test left CUDA errors unread: {errors}")


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> str:
    """A tiny Llama with a trained BPE tokenizer and a chat template, as a model directory."""
    from tests.checkpoint import save_checkpoint

    return str(save_checkpoint(tmp_path_factory.mktemp("chat-model")))


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port (tests/redis_server.py), stopped at the end."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def two_servers(tmp_path):
    """Two real redis-servers on free loopback ports, stopped at the end."""
    from tests.redis_server import RedisServer

    servers = [RedisServer(tmp_path / f"redis{i}") for i in range(2)]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()
