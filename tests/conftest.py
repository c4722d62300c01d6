"""Shared fixtures: reference outputs from transformers `generate`; every test fails if the NVMe
store met an internal error (a bug it books apart from disk faults), unless marked
`allow_internal_errors`."""

from __future__ import annotations

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
