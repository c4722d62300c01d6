"""Remote tier throughput: blocks written and read through `RemoteStore` against the raw client
peak for the same value size, in the same run.

It starts its own `redis-server` on a free loopback port (temp dir, no persistence), unless
`--url` names one. For each round, on a flushed server:
  raw     redis-py's asyncio client alone, as fast as it goes: SET then GET of N values of the
          tier's value size (block + 4 KiB header) from ready-made bytes, `--in-flight`
          pipelines of `--pipeline` commands at once (the tier's own settings): no header
          packing, no checksum, no copy into a block;
  store   RemoteStore.submit_write of N blocks (copy, xxh3, header, EXISTS then SET), wait for
          all; then submit_read of all of them into other blocks (GET, header and payload xxh3
          checked, copied), wait; the blocks come back bit-identical.
After an untimed warm-up of both (the server's memory and this process's are faulted in), the
rounds alternate which goes first. Each store figure is divided by the raw figure of its own
round; medians over rounds are
printed with the range of the ratios (target: >= 80%). With `--redis-benchmark`, the C client's
loopback peak for the same value size (`redis-benchmark -t set,get -d VALUE -P 16`, as many
clients as the store has reader threads) runs in every round too, and the store's reads are
printed as a ratio to its GET (the issue's target: >= 80%). Bytes counted are block payload bytes.
`--servers K` instead times the engine's store over K servers started here (blocks spread by
the tier's rendezvous hashing, `RemoteShards`, with `--read-threads` reader threads per server)
against the same store on one of them, the same bytes, in alternating rounds (the issue's target
for two servers: >= 1.8x one); with
`--apart`, also K processes at once, each a one-server store on its own server with 1/K of the
bytes: near Kx one server there, and not in the one process, puts the limit in the process.
`--read-sweep` instead times the store's reads alone for several block sizes and `recv_into`
piece sizes (`reader.RECV_CHUNK_BYTES`), the measurement its default comes from.

    python benchmarks/bench_remote.py --size 1GiB --block 2MiB --rounds 3 --redis-benchmark
    python benchmarks/bench_remote.py --size 256MiB --read-sweep
    python benchmarks/bench_remote.py --size 1GiB --servers 2 --apart --redis-benchmark
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import redis
import torch
from common import start_redis_server
from redis.asyncio import Redis

from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.remote import reader
from tieredkv.tiers.remote.shards import RemoteShards
from tieredkv.tiers.remote.store import READ_THREADS, RemoteStore
from tieredkv.tiers.remote.value_format import ValueLayout

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "": 1}
FINGERPRINT = 0xBE7C4


def parse_bytes(text: str) -> int:
    for unit in ("KiB", "MiB", "GiB", ""):
        if text.endswith(unit) and text[: len(text) - len(unit)].strip().isdigit():
            return int(text[: len(text) - len(unit)]) * UNITS[unit]
    raise argparse.ArgumentTypeError(f"{text!r}: give bytes like 1GiB, 2MiB, 4096")


async def raw_round(url: str, value: bytes, n: int, in_flight: int, pipeline: int) -> tuple[float, float]:
    """(SET, GET) seconds for `n` values through redis-py alone."""
    client = Redis.from_url(url, max_connections=in_flight)
    slots = asyncio.Semaphore(in_flight)
    batches = [range(i, min(n, i + pipeline)) for i in range(0, n, pipeline)]

    async def run(batch: range, write: bool) -> None:
        async with slots, client.pipeline(transaction=False) as pipe:
            for i in batch:
                pipe.set(f"raw:{i}", value) if write else pipe.get(f"raw:{i}")
            results = await pipe.execute()
        assert write or all(len(r) == len(value) for r in results), "a raw GET came back short"

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(run(b, True) for b in batches))
        t1 = time.perf_counter()
        await asyncio.gather(*(run(b, False) for b in batches))
        t2 = time.perf_counter()
        await client.unlink(*(f"raw:{i}" for i in range(n)))
    finally:
        await client.aclose()
    return t1 - t0, t2 - t1


def engine_store(urls: list[str], block_bytes: int, args: argparse.Namespace) -> RemoteStore | RemoteShards:
    """The engine's store of `block_bytes` blocks over `urls` (as `open_remote` makes it), with
    this run's pipelines in flight, commands per pipeline and reader threads per server."""
    stores = [RemoteStore(url, block_bytes, FINGERPRINT, 16, max_in_flight=args.in_flight,
                          pipeline_ops=args.pipeline, read_threads=args.read_threads) for url in urls]
    return stores[0] if len(stores) == 1 else RemoteShards(stores)


def store_round(url: str, args: argparse.Namespace, src: torch.Tensor, dst: torch.Tensor,
                first_hash: int) -> tuple[float, float]:
    """(write, read) seconds for every block of `src` through a fresh RemoteStore."""
    return timed_round(engine_store([url], src.shape[1], args), src, dst, first_hash)


def timed_round(store: RemoteStore | RemoteShards, src: torch.Tensor, dst: torch.Tensor,
                first_hash: int, together: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """(write, read) seconds for every block of `src` through `store`, which is then closed;
    every job succeeds and the blocks come back bit-identical into `dst`. `together` is called
    before each of the two phases (a barrier, where several processes time theirs at once)."""
    n = src.shape[0]
    refs = [BlockRef(first_hash + i, first_hash + i - 1, tuple(range(16))) for i in range(n)]
    # each block's view made before the clock starts, as the engine makes its CPU blocks' views
    # once: indexing a tensor per block gives up the GIL and waits behind the reader threads
    src_blocks, dst_blocks = src.unbind(0), dst.unbind(0)
    with store:
        together()
        t0 = time.perf_counter()
        jobs = [store.submit_write(ref, src_blocks[i]) for i, ref in enumerate(refs)]
        ok_w = None not in jobs and all(store.wait(jobs).values())
        t1 = time.perf_counter()
        together()
        t2 = time.perf_counter()
        jobs = [store.submit_read(ref, dst_blocks[i]) for i, ref in enumerate(refs)]
        ok_r = None not in jobs and all(store.wait(jobs).values())
        t3 = time.perf_counter()
        errors = store.stats()["remote_errors"]
    assert ok_w and ok_r and not errors, f"a benchmark job failed ({errors} errors)"
    assert torch.equal(src, dst), "blocks read back differ from the ones written"
    return t1 - t0, t3 - t2


def apart_round(urls: list[str], num_blocks: int, args: argparse.Namespace) -> tuple[float, float]:
    """(write, read) seconds for `num_blocks` blocks split over one process per server, each
    with a one-server store of its own, the processes starting each phase together (the
    slowest sets the time): what the servers and this machine give when no process serves
    two of them, beside the one process over all of them."""
    for url in urls:  # blocks of an earlier round, under the same hashes, would be found and not written
        redis.Redis.from_url(url).flushall()
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(urls)), ctx.Queue()
    procs = [ctx.Process(target=_apart_worker, args=(url, -(-num_blocks // len(urls)), args, barrier, results))
             for url in urls]
    for proc in procs:
        proc.start()
    secs = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return max(w for w, _ in secs), max(r for _, r in secs)


def _apart_worker(url: str, num_blocks: int, args: argparse.Namespace, barrier, results) -> None:
    src = torch.randint(0, 256, (num_blocks, args.block), dtype=torch.uint8)
    results.put(timed_round(engine_store([url], args.block, args), src, torch.zeros_like(src), first_hash=1,
                            together=barrier.wait))


def redis_benchmark(url: str, value_bytes: int, n: int, clients: int, pipeline: int = 16) -> dict[str, float]:
    """GB/s of SET and GET of `value_bytes` values by the C client, `redis-benchmark`."""
    return redis_benchmark_together([url], value_bytes, n, clients, pipeline)


def redis_benchmark_together(urls: list[str], value_bytes: int, n: int, clients: int,
                             pipeline: int = 16) -> dict[str, float]:
    """GB/s of SET and GET by one `redis-benchmark` per server, all at once, summed ({} without
    the binary). Each runs SET then GET; the GETs overlap for nearly all their time."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {}
    runs = []
    for url in urls:
        port = url.rsplit(":", 1)[1].split("/")[0]
        cmd = [binary, "-p", port, "-t", "set,get", "-d", str(value_bytes), "-n", str(n), "-c", str(clients),
               "-P", str(pipeline), "-r", str(n), "--csv"]
        runs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    rates: dict[str, float] = {}
    for run in runs:
        out, _ = run.communicate()
        if run.returncode:
            raise subprocess.CalledProcessError(run.returncode, run.args)
        for line in out.splitlines()[1:]:
            name, rps = line.split(",")[:2]
            key = name.strip('"').lower()
            rates[key] = rates.get(key, 0.0) + float(rps.strip('"')) * value_bytes / 1e9
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an existing server (default: start redis-server on a free port)")
    parser.add_argument("--server-bin", default="redis-server", help="the redis-server to start")
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("1GiB"), help="payload bytes each way")
    parser.add_argument("--block", type=parse_bytes, default=parse_bytes("2MiB"), help="CPU block bytes")
    parser.add_argument("--in-flight", type=int, default=8, help="pipelines in flight (the tier's default)")
    parser.add_argument("--pipeline", type=int, default=8, help="commands per pipeline (the tier's default)")
    parser.add_argument("--read-threads", type=int, default=READ_THREADS, help="the store's reader threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--read-sweep", action="store_true", help="reads only, over block and recv piece sizes")
    parser.add_argument("--servers", type=int, help="time K servers against one (starts K redis-servers)")
    parser.add_argument("--redis-benchmark", action="store_true", help="also run the C client's peak")
    parser.add_argument("--apart", action="store_true",
                        help="with --servers: also one process per server at once (is the limit this process?)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.servers:
        servers = [start_redis_server(args.server_bin) for _ in range(args.servers)]
        try:
            scaling(args, [url for _, url in servers])
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait()
        return

    proc, url = (None, args.url) if args.url else start_redis_server(args.server_bin)
    try:
        read_sweep(args, url) if args.read_sweep else run(args, url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()


def run(args: argparse.Namespace, url: str) -> None:
    n = args.size // args.block
    src = torch.randint(0, 256, (n, args.block), dtype=torch.uint8)
    dst = torch.zeros_like(src)  # pages faulted in now, as an engine's CPU pool's are
    with RemoteStore(url, args.block, FINGERPRINT, 16) as probe:
        value_bytes = probe.layout.value_bytes
        if not probe.stats()["remote_connected"]:
            sys.exit(f"cannot reach {url}")
    value = bytes(torch.randint(0, 256, (value_bytes,), dtype=torch.uint8).numpy())
    client = redis.Redis.from_url(url)
    secs: dict[str, list[float]] = {k: [] for k in ("raw_set", "raw_get", "store_write", "store_read")}
    c_gets: list[float] = []  # redis-benchmark's GET GB/s, each round
    # untimed warm-up: the server's and this process's memory for the values is faulted in
    asyncio.run(raw_round(url, value, n, args.in_flight, args.pipeline))
    store_round(url, args, src, dst, first_hash=1 << 62)
    for r in range(args.rounds):  # interleaved, in turns, so that drift hits both alike
        client.flushall()
        if r % 2:
            store = store_round(url, args, src, dst, first_hash=(r + 1) << 32)
            client.flushall()
        raw = asyncio.run(raw_round(url, value, n, args.in_flight, args.pipeline))
        if not r % 2:
            client.flushall()
            store = store_round(url, args, src, dst, first_hash=(r + 1) << 32)
        for key, s in zip(secs, (*raw, *store), strict=True):
            secs[key].append(s)
        if args.redis_benchmark:
            client.flushall()
            c_gets.append(redis_benchmark(url, value_bytes, max(n, 256), args.read_threads).get("get", 0.0))
    gbs = {k: [n * args.block / s / 1e9 for s in v] for k, v in secs.items()}
    med = {k: statistics.median(v) for k, v in gbs.items()}
    print(f"{n * args.block / 2**30:.2f} GiB each way in {args.block >> 10} KiB blocks ({value_bytes} B values), "
          f"{args.in_flight} pipelines x {args.pipeline} in flight, {args.rounds} rounds, hiredis="
          f"{redis.utils.HIREDIS_AVAILABLE}; GB/s of payload, medians")
    print(f"  raw redis-py:  SET {med['raw_set']:5.2f}  GET {med['raw_get']:5.2f}")
    for name, key, peak in (("write", "store_write", "raw_set"), ("read ", "store_read", "raw_get")):
        ratios = [a / b for a, b in zip(gbs[key], gbs[peak], strict=True)]  # same round
        print(f"  store {name}:   {med[key]:5.2f} = {100 * statistics.median(ratios):3.0f}% "
              f"[{100 * min(ratios):.0f}..{100 * max(ratios):.0f}] of raw {peak[4:].upper()}")
    if c_gets:
        ratios = [a / b for a, b in zip(gbs["store_read"], c_gets, strict=True)]
        print(f"  redis-benchmark (C) GET -P 16 -c {args.read_threads}: {statistics.median(c_gets):5.2f}; store read = "
              f"{100 * statistics.median(ratios):3.0f}% [{100 * min(ratios):.0f}..{100 * max(ratios):.0f}] of it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "value_bytes": value_bytes, "gb_per_s": gbs, "median": med,
                       "redis_benchmark_get": c_gets}, f, indent=1)


def scaling(args: argparse.Namespace, urls: list[str]) -> None:
    """Write and read GB/s of the engine's store over all `urls` against over `urls[0]` alone."""
    n = args.size // args.block
    src = torch.randint(0, 256, (n, args.block), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    secs: dict[str, list[tuple[float, float]]] = {"one": [], "all": []}
    for r in range(args.rounds + 1):  # round 0 warms both up, untimed
        for name in (("one", "all") if r % 2 else ("all", "one")):
            for url in urls:
                redis.Redis.from_url(url).flushall()
            dst.zero_()
            store = engine_store(urls[:1] if name == "one" else urls, args.block, args)
            seconds = timed_round(store, src, dst, first_hash=1)
            if r:
                secs[name].append(seconds)
    print(f"{n * args.block / 2**30:.2f} GiB each way in {args.block >> 10} KiB blocks, {len(urls)} servers "
          f"against one, {args.rounds} rounds; GB/s of payload, medians")
    rates = {}
    for i, what in enumerate(("write", "read")):
        for name in secs:
            rates[f"{name}_{what}"] = statistics.median(n * args.block / s[i] / 1e9 for s in secs[name])
        print(f"  {what}: one server {rates[f'one_{what}']:5.2f}, {len(urls)} servers {rates[f'all_{what}']:5.2f} "
              f"({rates[f'all_{what}'] / rates[f'one_{what}']:.2f}x)")
    if args.apart:
        apart = [apart_round(urls, n, args) for _ in range(args.rounds)]
        for i, what in enumerate(("write", "read")):
            rates[f"apart_{what}"] = statistics.median(n * args.block / s[i] / 1e9 for s in apart)
            print(f"  {what}: {len(urls)} processes, one server each, at once {rates[f'apart_{what}']:5.2f} "
                  f"({rates[f'apart_{what}'] / rates[f'one_{what}']:.2f}x one server)")
    if args.redis_benchmark:  # the C client: how far the servers and this machine scale at all
        value_bytes = ValueLayout.for_block(args.block, 16, FINGERPRINT).value_bytes
        one = redis_benchmark(urls[0], value_bytes, max(n, 256), args.read_threads)
        together = redis_benchmark_together(urls, value_bytes, max(n, 256), args.read_threads)
        for what in ("set", "get"):
            rates[f"c_one_{what}"], rates[f"c_all_{what}"] = one.get(what, 0.0), together.get(what, 0.0)
            if rates[f"c_one_{what}"]:
                print(f"  redis-benchmark (C) {what.upper()}: one server {rates[f'c_one_{what}']:5.2f}, {len(urls)} "
                      f"at once {rates[f'c_all_{what}']:5.2f} ({rates[f'c_all_{what}'] / rates[f'c_one_{what}']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "servers": len(urls), "median_gb_per_s": rates, "secs": secs}, f, indent=1)


SWEEP_BLOCKS = (256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
SWEEP_CHUNKS = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def read_sweep(args: argparse.Namespace, url: str) -> None:
    """The store's read GB/s (median of rounds) for each block size and recv_into piece size."""
    print(f"store reads, GB/s of payload (median of {args.rounds}), {args.read_threads} reader threads; "
          f"rows: block bytes, columns: recv_into piece bytes")
    print("block     " + "".join(f"{c >> 10:>8} K" for c in SWEEP_CHUNKS))
    for block in SWEEP_BLOCKS:
        n = args.size // block
        src = torch.randint(0, 256, (n, block), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        row = []
        for chunk in SWEEP_CHUNKS:
            reader.RECV_CHUNK_BYTES = chunk
            reads = [store_round(url, args, src, dst, first_hash=(r + 1) << 32)[1] for r in range(args.rounds)]
            row.append(n * block / statistics.median(reads) / 1e9)
            redis.Redis.from_url(url).flushall()
        print(f"{block >> 10:>6} K " + "".join(f"{g:10.2f}" for g in row), flush=True)


if __name__ == "__main__":
    main()
