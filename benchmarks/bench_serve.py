"""The cost of the HTTP path: one workload through in-process `AsyncLLM`, then through
`tieredkv serve` (a subprocess on this host) with a streaming client over loopback HTTP, once
per `--server-modes` entry: `process` (the server's default: the engine in a process of its
own) and `thread` (`--engine-loop thread`: the engine in a thread of the server's process).
Same engine configuration, same requests (random token-id prompts, greedy, EOS ignored, so
every request yields exactly `--new` tokens), `--concurrency` streams at a time. Prints output
tokens/s, TTFT / ITL p50 and the CPU time per output token of the processes that run the engine
(in-process: the engine with its clients; HTTP: the server and its engine process, not the
client) of each, and the
HTTP figures as ratios to the in-process ones (the peak of this measurement: the engine with no
server in front of it).

    python benchmarks/bench_serve.py [--model llama-3-8b] [--concurrency 64] [--requests 256]
        [--prompt 1024] [--new 128] [--server-modes process,thread] [--json out.json]
    python benchmarks/bench_serve.py --model tiny-llama --device cpu --concurrency 8 \\
        --requests 32 --prompt 32 --new 16     # a smoke run anywhere

After the timed drives each path also answers `--samples-n` samples (seeded, temperature 1) of
four prompts, one request at a time; the script reports how many of them got over HTTP the
samples in-process gave, and exits with 1 if any did not.

`--py-spy DIR` samples the processes during each measured drive (py-spy, every thread, idle
ones too, collapsed stacks): `in-process.txt` (the engine with its clients),
`http-<mode>-server.txt` (with its engine process) and `http-<mode>-client.txt`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import torch
import yaml
from common import report, write_json

import tieredkv
from tieredkv import AsyncLLM, SamplingParams
from tieredkv.config import EngineConfig

Stream = Callable[[list[int]], AsyncIterator[float]]  # yields the time of each token


@dataclass
class Run:
    """What the clients of one run saw."""

    elapsed_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    samples: list[list[list[int]]] = field(default_factory=list)  # per seeded request, its n samples' ids
    cpu_s: float = 0.0  # CPU time of the process that ran the engine (in-process: with its clients)
    client_cpu_s: float = 0.0  # HTTP: CPU time of the client process (this one)

    def add(self, start: float, times: list[float]) -> None:
        self.tokens += len(times)
        self.ttfts.append(times[0] - start)
        self.itls += [b - a for a, b in zip(times, times[1:], strict=False)]


async def drive(stream: Stream, prompts: list[list[int]], concurrency: int, new_tokens: int) -> Run:
    """Send every prompt, `concurrency` at a time; record each token's arrival."""
    run, gate = Run(), asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> None:
        async with gate:
            start = time.perf_counter()
            times = [t async for t in stream(prompt)]
            assert len(times) == new_tokens, f"a request got {len(times)} of {new_tokens} tokens"
            run.add(start, times)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    run.elapsed_s = time.perf_counter() - start
    return run


@contextlib.contextmanager
def sampled(folder: str | None, name: str, pid: int) -> Iterator[None]:
    """py-spy samples process `pid` while the block runs; its collapsed stacks go to
    `folder/name.txt` (nothing without a folder)."""
    if folder is None:
        yield
        return
    out = os.path.join(folder, f"{name}.txt")
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "100", "--threads", "--idle",
                            "--subprocesses", "--format", "raw", "--output", out, "--nonblocking"],
                           stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
        spy.wait(timeout=60)


def in_process(config: EngineConfig, warm: list[list[int]], prompts: list[list[int]], args) -> Run:
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)

    async def main() -> Run:
        allm = AsyncLLM(config=config)

        async def stream(prompt: list[int]) -> AsyncIterator[float]:
            async for _ in allm.generate_stream(prompt, params):
                yield time.perf_counter()

        await drive(stream, warm, args.concurrency, args.new)
        start = _own_cpu_s()
        with sampled(args.py_spy, "in-process", os.getpid()):
            run = await drive(stream, prompts, args.concurrency, args.new)
        run.cpu_s = _own_cpu_s() - start
        for seed, prompt in enumerate(warm[:SEEDED_REQUESTS]):
            out = await allm.generate(prompt, seeded(args.samples_n, seed, args.new))
            run.samples.append([list(c.token_ids) for c in out.outputs])
        await allm.close()
        return run

    return asyncio.run(main())


SEEDED_REQUESTS = 4


def seeded(n: int, seed: int, new_tokens: int) -> SamplingParams:
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=new_tokens, ignore_eos=True)


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process and of its live children (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(map(_process_cpu_s, children))


def start_server(config: EngineConfig, folder: str, mode: str) -> tuple[subprocess.Popen, str]:
    """`tieredkv serve --engine-loop mode` on a free port with the same engine keys; (process, base URL)."""
    doc = config.to_dict()
    path = os.path.join(folder, "engine.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({**doc["model"], "cache": doc["cache"], "scheduler": doc["scheduler"]}, f)
    command = [sys.executable, "-m", "tieredkv.cli", "serve", path, "--port", "0", "--served-model-name", "bench",
               "--engine-loop", mode]
    # the server runs the tieredkv this script imported
    root = os.path.dirname(os.path.dirname(os.path.abspath(tieredkv.__file__)))
    path_env = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path_env}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        print(f"  server: {line.rstrip()}", flush=True)
        if match := re.search(r"at (http://\S+)/v1", line):
            return proc, match.group(1)
    raise SystemExit(f"the server exited ({proc.wait()}) before it listened")


def over_http(config: EngineConfig, warm: list[list[int]], prompts: list[list[int]], args, mode: str) -> Run:
    with tempfile.TemporaryDirectory() as folder:
        proc, url = start_server(config, folder, mode)
        try:
            return asyncio.run(_http_runs(url, warm, prompts, args, proc.pid, mode))
        finally:
            proc.terminate()
            proc.wait(timeout=60)


async def _http_runs(url: str, warm: list[list[int]], prompts: list[list[int]], args, server_pid: int,
                     mode: str) -> Run:
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:

        async def stream(prompt: list[int]) -> AsyncIterator[float]:
            body = {"model": "bench", "prompt": prompt, "max_tokens": args.new, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):  # one token per chunk
                        yield time.perf_counter()

        await drive(stream, warm, args.concurrency, args.new)
        start, client_start = _process_cpu_s(server_pid), _own_cpu_s()
        with (sampled(args.py_spy, f"http-{mode}-server", server_pid),
              sampled(args.py_spy, f"http-{mode}-client", os.getpid())):
            run = await drive(stream, prompts, args.concurrency, args.new)
        run.cpu_s, run.client_cpu_s = _process_cpu_s(server_pid) - start, _own_cpu_s() - client_start
        for seed, prompt in enumerate(warm[:SEEDED_REQUESTS]):
            body = {"model": "bench", "prompt": prompt, "n": args.samples_n, "seed": seed, "temperature": 1.0,
                    "max_tokens": args.new, "ignore_eos": True, "return_token_ids": True}
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            choices = sorted(response.json()["choices"], key=lambda c: c["index"])
            run.samples.append([c["token_ids"] for c in choices])
        return run


def summarize(name: str, run: Run, base: Run | None) -> list[dict]:
    tok_s = run.tokens / run.elapsed_s
    ttft, itl = statistics.median(run.ttfts) * 1e3, statistics.median(run.itls) * 1e3
    cpu_ms = run.cpu_s / run.tokens * 1e3
    if base is None:
        return [report(f"{name}: output tokens/s", tok_s, "tok/s"), report(f"{name}: TTFT p50", ttft, "ms"),
                report(f"{name}: ITL p50", itl, "ms"), report(f"{name}: engine process CPU per token", cpu_ms, "ms")]
    base_tok_s = base.tokens / base.elapsed_s
    records = [report(f"{name}: output tokens/s", tok_s, "tok/s", base_tok_s, "in-process")]
    for label, value, base_value in (("TTFT p50", ttft, statistics.median(base.ttfts) * 1e3),
                                     ("ITL p50", itl, statistics.median(base.itls) * 1e3)):
        records.append(report(f"{name}: {label} (+{value - base_value:.1f} ms)", value, "ms", base_value,
                              "in-process"))
    records.append(report(f"{name}: engine process CPU per token", cpu_ms, "ms", base.cpu_s / base.tokens * 1e3,
                          "in-process"))
    records.append(report(f"{name}: client process CPU (of its wall time)", run.client_cpu_s / run.elapsed_s * 100,
                          "%", 100.0, "one core"))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=128, help="output tokens per request")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--samples-n", type=int, default=8, help="samples per seeded request (the tokens check)")
    parser.add_argument("--server-modes", type=_modes, default=["process"],
                        help="comma-separated --engine-loop values of the servers to measure (process, thread; "
                        "default: process)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--py-spy", metavar="DIR", help="sample the processes of each measured drive into DIR")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    config = EngineConfig.from_kwargs(
        model=args.model, device=args.device, dtype=dtype, max_num_seqs=max(args.concurrency, 8),
        max_num_batched_tokens=8192, preemption="recompute",
        **({"gpu_memory_utilization": args.gpu_memory_utilization} if args.device == "cuda"
           else {"num_gpu_blocks": args.concurrency * (-(-(args.prompt + args.new) // 16) + 1)}),
    )
    rng = random.Random(0)
    vocab = 500  # ids every preset and real vocabulary has; 3.. avoids BOS / EOS of the tiny presets
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    warm = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.concurrency)]
    print(f"{args.requests} requests of {args.prompt} + {args.new} tokens, {args.concurrency} at a time, "
          f"{args.model} on {args.device} ({dtype})", flush=True)
    base = in_process(config, warm, prompts, args)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the server process needs the memory the engine held
    records = summarize("in-process AsyncLLM", base, None)
    differ = False
    for mode in args.server_modes:
        http = over_http(config, warm, prompts, args, mode)
        records += summarize(f"HTTP (tieredkv serve --engine-loop {mode}, loopback)", http, base)
        same = sum(a == b for a, b in zip(base.samples, http.samples, strict=True))
        records.append(report(f"{mode}: n={args.samples_n} seeded requests whose samples over HTTP equal "
                              "in-process", same, "requests", len(base.samples), "sent"))
        differ = differ or same < len(base.samples)
    write_json(args.json, records)
    if differ:
        sys.exit("some seeded samples over HTTP differ from in-process")


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    wrong = [m for m in modes if m not in ("process", "thread")]
    if wrong:
        raise argparse.ArgumentTypeError(f"expected process, thread or both (comma-separated), got {text!r}")
    return modes


if __name__ == "__main__":
    main()
