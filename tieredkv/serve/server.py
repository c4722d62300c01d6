"""Running the server: the start-up report and uvicorn on a socket bound first.

Operations:
- `startup_report(info)`: tier sizes (blocks and tokens per tier), the cost model, the I/O backend.
- `listen(host, port)`: a listening socket (port 0: any free port).
- `make_server(app, log_level)`: the uvicorn server of an application; `run(sockets=[sock])`.
- `serve(config, host, port, engine_process=True)`: all of it, until interrupted (the engine in
  a process of its own, or in a thread of the server's).
"""

from __future__ import annotations

import socket
from typing import Any

from tieredkv.async_engine import AsyncLLM
from tieredkv.config import EngineConfig
from tieredkv.engine_core.info import EngineInfo


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _tier(blocks: int, block_size: int, block_bytes: int) -> str:
    return f"{blocks:,} blocks x {block_size} tokens = {blocks * block_size:,} tokens ({_size(blocks * block_bytes)})"


def _cost_model(info: EngineInfo) -> str:
    cost = info.cost_model
    if cost is None:
        return "none (no CPU tier, or preemption: recompute without an NVMe tier)"
    source = "pinned in the config" if info.config.scheduler.cost_model is not None else "measured at start-up"
    disk = "" if cost.disk_read_bytes_per_s is None else f", disk read {_size(cost.disk_read_bytes_per_s)}/s"
    return (f"{source}: D2H {_size(cost.d2h_bytes_per_s)}/s, H2D {_size(cost.h2d_bytes_per_s)}/s, prefill "
            f"{cost.prefill_s_per_token:.3g} s/token + {cost.prefill_s_per_token_sq:.3g} s/token^2{disk}")


def _remote(info: EngineInfo, stats: dict) -> str:
    from tieredkv.tiers.remote.connection import redacted

    url, budget = info.config.cache.remote_url, info.config.cache.remote_bytes
    if url is None:
        return "none"
    state = "connected" if stats["remote_connected"] else "not reachable now (the engine retries every second)"
    return f"{redacted(url)}, {state}, storing {'up to ' + _size(budget) if budget else 'what the server keeps'}"


def startup_report(info: EngineInfo) -> str:
    """What the engine was built with, as `tieredkv serve` prints it before the URL."""
    config, stats = info.config, info.startup_stats
    block_size, block_bytes = config.cache.block_size, info.block_bytes
    cpu = stats.get("cpu_blocks_total")
    nvme = stats.get("nvme_slots_total")
    rows = [
        ("model", f"{config.model.model} on {config.model.device} ({config.model.dtype}), "
                  f"requests up to {info.limits.max_request_tokens:,} tokens"),
        ("GPU tier", _tier(stats["gpu_blocks_total"], block_size, block_bytes)),
        ("CPU tier", "none" if cpu is None else _tier(cpu, block_size, block_bytes)),
        ("NVMe tier",
         "none" if nvme is None else f"{_tier(nvme, block_size, block_bytes)} at {config.cache.nvme_path}"),
        ("remote tier", _remote(info, stats)),
        ("preemption", config.scheduler.preemption),
        ("cost model", _cost_model(info)),
        ("I/O backend", stats.get("nvme_io_backend", f"none (no NVMe tier; configured: {config.cache.io_backend})")),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host:port` (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"--host/--port: cannot listen on {host}:{port} ({err})") from err
    sock.listen(2048)
    return sock


def make_server(app: Any, log_level: str = "warning") -> Any:
    """A uvicorn server for `app`; `server.run(sockets=[sock])` blocks until `should_exit`."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=30))


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(config: EngineConfig, host: str, port: int, model_name: str | None = None,
          engine_process: bool = True) -> None:
    """Build the engine (in a process of its own unless `engine_process` is False), print the
    start-up report and the URL, serve until interrupted."""
    from tieredkv.serve.app import build_app

    sock = listen(host, port)
    allm = AsyncLLM(config=config, engine_process=engine_process)
    name = model_name or config.model.model
    print(startup_report(allm.info), flush=True)
    print(f"serving {name!r} at {url_of(sock)}/v1 (OpenAI API), /metrics, /health", flush=True)
    make_server(build_app(allm, name), log_level="info").run(sockets=[sock])
