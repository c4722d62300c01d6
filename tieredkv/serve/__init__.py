"""`tieredkv serve`: an OpenAI-compatible HTTP server over `AsyncLLM` (FastAPI + uvicorn).

Modules: `protocol` (request bodies, and how they become `SamplingParams`), `handlers`
(completions and chat completions, whole or streamed), `app` (routes, error objects, /metrics),
`server` (start-up report, uvicorn). This module holds the command line only, so that
`tieredkv --help` does not import the web stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tieredkv.config import EngineConfig


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `serve` subcommand."""
    serve = commands.add_parser(
        "serve", help="serve the engine over an OpenAI-compatible HTTP API",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (with SSE streaming), "
        "/tokenize, /detokenize, /health and /metrics. The YAML file holds the engine keys (model, device, "
        "dtype, cache, scheduler); its experiment sections are ignored.",
    )
    serve.add_argument("config", nargs="?", help="YAML file with the engine keys (optional with --model)")
    serve.add_argument("--model", help="preset name or model directory (overrides the file's)")
    serve.add_argument("--served-model-name", help="the name clients use in `model` (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: 8000; 0: any free)")
    serve.add_argument("--engine-loop", choices=("process", "thread"), default="process",
                       help="where the engine loop runs: a process of its own, so the web server never holds "
                       "the GIL it needs (default), or a thread of the server's process")


def port_number(value: str) -> int:
    """A TCP port from the command line (0: any free one); argparse names the flag on error."""
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError(value)
    return port


def main(args: argparse.Namespace) -> int:
    """Run `tieredkv serve` until interrupted; 2 and one `tieredkv: error:` line on a bad start."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        print(f"tieredkv: error: serve needs fastapi and uvicorn ({err}): pip install 'tieredkv[serve]'",
              file=sys.stderr)
        return 2
    from tieredkv.serve.server import serve

    try:
        config, scratch = engine_config(args.config, args.model)
        try:
            serve(config, args.host, args.port, args.served_model_name, engine_process=args.engine_loop == "process")
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
    except ValueError as err:
        print(f"tieredkv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut the server down, then raised it again
        return 130  # as `tieredkv run` (128 + SIGINT)
    return 0


def engine_config(path: str | None, model: str | None) -> tuple[EngineConfig, str | None]:
    """The engine keys of the YAML file at `path` (if any; read as `LLM.from_yaml` reads it),
    with `model` over its model; and the temporary folder standing for `${results}` (None if
    none), to remove when the server stops."""
    from tieredkv.config import EngineConfig, read_engine_config

    if path is None and model is None:
        raise ValueError("serve: give a CONFIG.yaml, --model, or both")
    config, scratch = read_engine_config(path) if path else (EngineConfig(), None)
    if model is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=model))
    return config, scratch
