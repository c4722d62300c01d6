"""What the NVMe store's threads cost the engine thread, on the CPU: the engine thread's time
for a fixed run of small torch ops (each releases the GIL and takes it back, as the engine's
launches and CUDA calls do), alone and while the store reads blocks back (`--op read`) or
writes new ones (`--op write`, as spills) as fast as it can, kept at `--in-flight` jobs, the
engine thread submitting them between its ops, as the engine does. Prints the engine thread's
ops/s both ways and its time lost per store job.

    python benchmarks/store_gil_cost.py [--op read|write] [--block-kib 256] [--blocks 512] [--ops 200000]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.nvme import NVMeStore
from tieredkv.tiers.nvme.slot_format import aligned_empty

BLOCK_SIZE = 16


def engine_ops(count: int, store: NVMeStore | None, refs: list[BlockRef], blocks: torch.Tensor,
               in_flight: int, every: int, op: str = "read") -> tuple[float, int]:
    """Seconds for `count` small torch ops and the store jobs done meanwhile; with a store,
    keep `in_flight` reads of `refs` (or writes of new blocks) going."""
    x = torch.zeros(8)
    pending: set[int] = set()
    done = 0
    nxt = 0
    start = time.perf_counter()
    for i in range(count):
        x.add_(1)
        if store is not None and i % every == 0:
            for job, _ok in store.poll():
                pending.discard(job)
                done += 1
            want = in_flight - len(pending)
            if want <= 0:
                continue
            if op == "read":
                picked = [(nxt + k) % len(refs) for k in range(want)]
                pending.update(store.submit_reads([(refs[k], blocks[k]) for k in picked]))
            else:
                for k in range(nxt + 1, nxt + want + 1):  # new blocks: hashes past the stored ones
                    job = store.submit_write(BlockRef(len(refs) + k, 0, refs[0].token_ids), blocks[k % len(blocks)])
                    if job is not None:
                        pending.add(job)
            nxt += want
    elapsed = time.perf_counter() - start
    if store is not None:
        store.wait(list(pending))
    return elapsed, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=("read", "write"), default="read")
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--every", type=int, default=50, help="ops between two polls/submits")
    parser.add_argument("--backend", default="uring")
    parser.add_argument("--dir", default=None, help="where the store file goes (default: a temporary folder)")
    args = parser.parse_args()
    block_bytes = args.block_kib << 10
    memory = aligned_empty(args.blocks * block_bytes)
    blocks = memory.view(args.blocks, block_bytes)
    blocks.random_(0, 255)
    with tempfile.TemporaryDirectory(dir=args.dir) as path:
        store = NVMeStore(path, (args.blocks + 8) * (block_bytes + 8192), block_bytes, b"gil", BLOCK_SIZE,
                          backend=args.backend, policy="lru")  # lru: every new block is written
        try:
            refs = [BlockRef(i + 1, i, tuple(range(BLOCK_SIZE))) for i in range(args.blocks)]
            store.wait([job for ref, block in zip(refs, blocks, strict=True)
                        if (job := store.submit_write(ref, block)) is not None])
            alone, _ = engine_ops(args.ops, None, refs, blocks, args.in_flight, args.every)
            busy, jobs = engine_ops(args.ops, store, refs, blocks, args.in_flight, args.every, args.op)
            again, _ = engine_ops(args.ops, None, refs, blocks, args.in_flight, args.every)
        finally:
            store.close()
    base = min(alone, again)
    print(f"engine ops/s alone {args.ops / base:,.0f}, beside the store {args.ops / busy:,.0f} "
          f"({busy / base:.2f}x the time); {jobs} {args.op}s ({jobs / busy:,.0f}/s); "
          f"engine time lost per {args.op} {(busy - base) / max(jobs, 1) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
