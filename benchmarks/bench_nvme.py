"""NVMe tier throughput: spill and restore of CPU blocks against the disk's own sequential peak.

For each round, on the same directory:
  peak    a plain sequential O_DIRECT write, then read, of SIZE bytes in CHUNK pieces (like
          `dd oflag=direct` / `iflag=direct`), to a fresh preallocated file, then fsync;
  store   NVMeStore.submit_write of SIZE/BLOCK blocks, wait for all, fsync (spill); then
          submit_read of all of them into another buffer, wait (restore).
The peak is measured twice: one chunk at a time (dd's way) and with QUEUE_DEPTH chunks in flight
(the store's concurrency). Each round runs the three one after the other, so each store figure
is divided by the peaks of its own round (virtual disks drift a lot); the medians over rounds
are printed, with the range of the ratios (target: >= 90%). Bytes counted are block payload bytes;
slot headers (4 KiB a block) are overhead the store pays.

    python benchmarks/bench_nvme.py --dir /tmp --size 1GiB --block 2MiB --backend uring

`--behind-writes` measures instead how long reads take with writes in flight, as the engine's
spills leave them: 1 and 8 block reads alone, then submitted just after W = 1, 2, 4, 8 writes
of new blocks (`--write-depths`; the spill keeps up to 512 MiB in flight) (medians over
`--rounds`), and when those writes were done:

    python benchmarks/bench_nvme.py --dir /tmp --block 16MiB --behind-writes
    python benchmarks/bench_nvme.py --dir /tmp --block 2MiB --behind-writes --write-depths 8,64,256
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import get_args

import torch

from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.nvme.io_backends import IOBackend
from tieredkv.tiers.nvme.slot_format import SUPERBLOCK_BYTES, SlotGeometry, aligned_empty, byte_view
from tieredkv.tiers.nvme.store import NVMeStore

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "": 1}


def parse_bytes(text: str) -> int:
    for unit in ("KiB", "MiB", "GiB", ""):
        if text.endswith(unit) and text[: len(text) - len(unit)].strip().isdigit():
            return int(text[: len(text) - len(unit)]) * UNITS[unit]
    raise argparse.ArgumentTypeError(f"{text!r}: give bytes like 1GiB, 2MiB, 4096")


def sequential_peak(directory: str, size: int, chunk: int, depth: int = 1) -> tuple[float, float]:
    """(write, read) GB/s of O_DIRECT chunks in file order over a fresh preallocated file, then
    fsync; `depth` threads keep that many chunks in flight (1: like dd)."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="bench-seq-")
    os.close(fd)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = aligned_empty(chunk)
    buf.copy_(torch.arange(chunk, dtype=torch.int64).to(torch.uint8))
    view, offsets = byte_view(buf), range(0, size, chunk)
    try:
        os.posix_fallocate(fd, 0, size)
        with ThreadPoolExecutor(depth) as pool:
            t0 = time.perf_counter()
            assert set(pool.map(lambda off: os.pwritev(fd, [view], off), offsets)) == {chunk}
            os.fsync(fd)
            t1 = time.perf_counter()
            assert set(pool.map(lambda off: os.preadv(fd, [view], off), offsets)) == {chunk}
            t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    return size / (t1 - t0) / 1e9, size / (t2 - t1) / 1e9


@contextlib.contextmanager
def fresh_store(args: argparse.Namespace, num_blocks: int) -> Iterator[NVMeStore]:
    """A new store of `num_blocks` slots of `args.block` bytes, in a folder of its own under
    `args.dir` that is removed afterwards."""
    geometry = SlotGeometry.for_block(1 << 50, args.block, 16)
    capacity = SUPERBLOCK_BYTES + num_blocks * geometry.slot_bytes
    path = tempfile.mkdtemp(dir=args.dir, prefix="bench-store-")
    try:
        with NVMeStore(path, capacity, args.block, b"bench", 16, args.backend, args.queue_depth) as store:
            yield store
    finally:
        shutil.rmtree(path, ignore_errors=True)


def store_round(
    args: argparse.Namespace, src: torch.Tensor, dst: torch.Tensor
) -> tuple[float, float, str]:
    """(spill, restore) GB/s of all blocks of `src` through a fresh store, and its backend."""
    n = src.shape[0]
    tokens = list(range(16))
    with fresh_store(args, n) as store:
        t0 = time.perf_counter()
        jobs = [store.submit_write(BlockRef(i + 1, i, tokens), src[i]) for i in range(n)]
        ok_w = all(store.wait(jobs).values())
        assert store.sync()  # as the peak's fsync: count the data as on disk
        t1 = time.perf_counter()
        jobs = [store.submit_read(BlockRef(i + 1, i, tokens), dst[i]) for i in range(n)]
        ok_r = all(store.wait(jobs).values())
        t2 = time.perf_counter()
        backend = f"{store.stats()['backend']}, O_DIRECT={store.stats()['o_direct']}"
    assert ok_w and ok_r, "a benchmark job failed"
    assert torch.equal(src, dst), "restored blocks differ from the spilled ones"
    size = n * args.block
    return size / (t1 - t0) / 1e9, size / (t2 - t1) / 1e9, backend


def reads_behind_writes(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds: reads of 1 and 8 stored blocks alone, and submitted just after W writes
    of new blocks (`read{k}_after_{W}w`), with when those writes were done (`writes{W}_done`)."""
    tokens, depths, sizes, stored = list(range(16)), args.write_depths, (1, 8), 16
    num_writes = args.rounds * len(sizes) * sum(depths)
    src, dst = block_buffer(8, args.block, args.pin, args.unaligned), block_buffer(8, args.block, args.pin, False)
    figures: dict[str, list[float]] = {}
    new_hash = iter(range(stored + 1, stored + num_writes + 1))

    def ms_since(t: float) -> float:
        return (time.perf_counter() - t) * 1e3

    with fresh_store(args, stored + num_writes) as store:
        assert all(store.wait([store.submit_write(BlockRef(i + 1, i, tokens), src[i % 8])
                               for i in range(stored)]).values()), "a benchmark write failed"
        for r in range(args.rounds):
            for k in sizes:
                for w in (0, *depths):
                    start = time.perf_counter()
                    writes = [store.submit_write(BlockRef(h, 0, tokens), src[i % 8])
                              for i, h in enumerate(itertools.islice(new_hash, w))]
                    reads_at = time.perf_counter()
                    first = [(r + i) % stored for i in range(k)]
                    reads = store.submit_reads([(BlockRef(j + 1, j, tokens), dst[i]) for i, j in enumerate(first)])
                    assert len(reads) == k and all(store.wait(reads).values()), "a benchmark read failed"
                    figures.setdefault(f"read{k}_after_{w}w", []).append(ms_since(reads_at))
                    if w:
                        assert None not in writes and all(store.wait(writes).values()), "a write failed"
                        figures.setdefault(f"writes{w}_done", []).append(ms_since(start))
    return {key: statistics.median(values) for key, values in figures.items()}


def write_depths(text: str) -> tuple[int, ...]:
    """`--write-depths`: comma-separated counts of writes, each >= 1."""
    try:
        depths = tuple(int(x) for x in text.split(","))
    except ValueError:
        depths = ()
    if not depths or min(depths) < 1:
        raise argparse.ArgumentTypeError(f"expected counts of writes >= 1 like 8,64,256, got {text!r}")
    return depths


def block_buffer(num_blocks: int, block_bytes: int, pin: bool, unaligned: bool) -> torch.Tensor:
    """[num_blocks, block_bytes] uint8 host blocks: page-aligned (pinned memory is, too) unless
    `unaligned`, which shifts them 64 bytes as torch.empty's memory often is (bounce path)."""
    nbytes = num_blocks * block_bytes
    if pin:
        raw = torch.empty(nbytes + 64 * unaligned, dtype=torch.uint8, pin_memory=True)
    else:
        raw = aligned_empty(nbytes + 64 * unaligned)
    return raw[64 * unaligned :].view(num_blocks, block_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="directory on the disk to measure"
    )
    parser.add_argument(
        "--size", type=parse_bytes, default=parse_bytes("1GiB"), help="bytes moved each way"
    )
    parser.add_argument(
        "--block", type=parse_bytes, default=parse_bytes("2MiB"), help="CPU block bytes"
    )
    parser.add_argument(
        "--chunk", type=parse_bytes, default=parse_bytes("4MiB"), help="peak's I/O size"
    )
    parser.add_argument("--backend", choices=get_args(IOBackend), default="uring")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="pinned host blocks (needs CUDA)")
    parser.add_argument(
        "--unaligned", action="store_true", help="blocks off 4 KiB alignment (bounce buffers)"
    )
    parser.add_argument("--behind-writes", action="store_true", help="read latency with writes in flight")
    parser.add_argument("--write-depths", type=write_depths, default=(1, 2, 4, 8),
                        help="with --behind-writes: the writes in flight before the reads, e.g. 8,64,256")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.behind_writes:
        med = reads_behind_writes(args)
        print(f"{args.block >> 20} MiB blocks, {args.rounds} rounds, {args.dir}; ms, medians")
        for key, value in med.items():
            print(f"  {key:<16} {value:7.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "median": med}, f, indent=1)
        return

    n = args.size // args.block
    src = block_buffer(n, args.block, args.pin, args.unaligned)
    dst = block_buffer(n, args.block, args.pin, args.unaligned)
    src.view(torch.int64).copy_(torch.randint(-(2**62), 2**62, (n, args.block // 8)))
    dst.zero_()  # fault its pages in now, as an engine's CPU pool is, not during the first restore

    rows: dict[str, list[float]] = {k: [] for k in ("w1", "r1", "wq", "rq", "spill", "restore")}
    for _ in range(args.rounds):  # interleaved, so that drift of a virtual disk hits all alike
        w1, r1 = sequential_peak(args.dir, n * args.block, args.chunk)
        wq, rq = sequential_peak(args.dir, n * args.block, args.chunk, args.queue_depth)
        spill, restore, backend = store_round(args, src, dst)
        for key, value in zip(rows, (w1, r1, wq, rq, spill, restore), strict=True):
            rows[key].append(value)
    med = {k: statistics.median(v) for k, v in rows.items()}
    mib, qd = args.chunk >> 20, args.queue_depth
    print(
        f"{n * args.block / 2**30:.2f} GiB each way in {args.block >> 10} KiB blocks, "
        f"{args.rounds} rounds, {args.dir}; GB/s medians, [min..max] over rounds"
    )
    print(
        f"  peak  O_DIRECT sequential, {mib} MiB chunks, 1 at a time:  "
        f"write {med['w1']:5.2f}  read {med['r1']:5.2f}"
    )
    print(
        f"  peak  O_DIRECT sequential, {mib} MiB chunks, {qd} in flight: "
        f"write {med['wq']:5.2f}  read {med['rq']:5.2f}"
    )
    for name, key, w, q in (("spill  ", "spill", "w1", "wq"), ("restore", "restore", "r1", "rq")):
        # ratios pair each store figure with the peak measured just before it, in the same round
        to_1 = [a / b for a, b in zip(rows[key], rows[w], strict=True)]
        to_q = [a / b for a, b in zip(rows[key], rows[q], strict=True)]
        print(
            f"  store {name} ({backend}, qd {qd}): {med[key]:5.2f} GB/s = "
            f"{100 * statistics.median(to_1):3.0f}% [{100 * min(to_1):.0f}..{100 * max(to_1):.0f}] "
            f"of 1-at-a-time, {100 * statistics.median(to_q):3.0f}% "
            f"[{100 * min(to_q):.0f}..{100 * max(to_q):.0f}] of {qd}-in-flight"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "backend": backend, "rounds": rows, "median": med}, f, indent=1
            )


if __name__ == "__main__":
    main()
