"""Kernel benchmarks against peaks measured in the same run (needs CUDA).

Figures (one line each: name, value, peak, ratio):
- copy peak: `b.copy_(a)` on 1 GiB, bytes read + written;  matmul peak: bf16 8192^3;
- decode attention, Llama-3-8B shape, batch 64, context 8192, scattered 16- and 128-token blocks:
  K/V bytes read (a read-only stream can beat the copy figure, which mixes reads and writes:
  ratio > 100%);
- gather / scatter of 256 scattered Llama-3-8B blocks (2 MiB each): bytes read + written;
- prefill attention (causal TFLOP/s), Llama-3-8B heads, bf16: 16k, 32k and 64k tokens as a whole
  prompt and as their last 2048-token chunk over the rest cached (what a chunked prefill step
  computes), and 4 x 4k; our paged kernel on 16-token and 128-token pages and torch SDPA's flash
  and cuDNN backends (dense, KV heads expanded) side by side (`prefill_peers.py`), our kernel
  first checked against the reference (PASS/FAIL), each peer against ours.

    python benchmarks/bench_kernels.py [--json results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import prefill_peers
import torch
from tieredkv.kernels import gather_blocks, paged_attention, scatter_blocks

# Llama-3-8B attention / cache shape.
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 8, 128, 16
DTYPE = torch.bfloat16
LONG_CONTEXTS = (16384, 32768, 65536)
CHUNK = 2048


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    peak: float
    peak_name: str

    @property
    def ratio(self) -> float:
        return self.value / self.peak

    def line(self) -> str:
        return (f"{self.name:<34} {self.value:9.1f} {self.unit:<8} peak {self.peak:9.1f} "
                f"({self.peak_name})  ratio {self.ratio:6.1%}")


def time_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 10, inner: int = 5) -> float:
    """Median device milliseconds per call of `fn`, timed with CUDA events after warm-up.

    Each timed rep runs `inner` calls back to back, so the host-side cost of a call (argument
    checks, launch) overlaps the previous call's kernels, as it does in the engine's stream.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return sorted(times)[len(times) // 2]


def copy_peak_gbs() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read + written."""
    a = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e6


def matmul_peak_tflops() -> float:
    """bf16 8192^3 matrix product on random data."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=DTYPE)
    b = torch.randn(n, n, device="cuda", dtype=DTYPE)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def attention_inputs(
    q_lens: list[int], context_lens: list[int], spare_blocks: int = 64, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, ...]:
    """Random query, one layer's K/V cache with each sequence's blocks scattered at random."""
    blocks = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device="cuda")
    offset = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[offset : offset + n]
        offset += n
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, tables, cu, ctx


def bench_decode(
    copy_peak: float, batch: int = 64, context: int = 8192, block_size: int = BLOCK_SIZE
) -> Figure:
    args = attention_inputs([1] * batch, [context] * batch, block_size=block_size)
    ms = time_ms(lambda: paged_attention(*args, HEAD_DIM**-0.5))
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    name = f"decode attn b={batch} ctx={context} bs={block_size}"
    return Figure(name, kv_bytes / ms / 1e6, "GB/s", copy_peak, "copy")


def bench_prefill(matmul_peak: float) -> list[prefill_peers.ShapeResults]:
    """The prefill comparison (see prefill_peers' module doc), printed shape by shape."""
    scale = HEAD_DIM**-0.5
    print("\nprefill attention: correctness of our kernel (small batch, vs paged_attention_ref)")
    if not prefill_peers.check_ours(attention_inputs, scale):
        print("our prefill kernel disagrees with the reference: nothing timed")
        return []
    all_res = []
    for shape in prefill_peers.shapes(LONG_CONTEXTS, CHUNK):
        flops = prefill_peers.causal_flops(shape.q_lens, shape.ctx_lens, Q_HEADS, HEAD_DIM)
        res = prefill_peers.measure_shape(shape, attention_inputs, scale, flops)
        prefill_peers.print_shape(res, matmul_peak)
        all_res.append(res)
        torch.cuda.empty_cache()
    prefill_peers.print_summary(all_res, matmul_peak)
    return all_res


def prefill_rows(all_res: list[prefill_peers.ShapeResults], matmul_peak: float) -> list[dict]:
    return [{"shape": asdict(r.shape), "flops": r.flops,
             "results": [{**asdict(x), "ratio_to_mm_peak": x.tflops / matmul_peak if x.tflops else None}
                         for x in r.results]} for r in all_res]


def bench_block_copy(copy_peak: float, num_ids: int = 256, num_blocks: int = 1024) -> list[Figure]:
    shape = (LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kv_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    ids = torch.randperm(num_blocks, device="cuda")[:num_ids]
    staging = torch.empty((num_ids, *shape[:2], *shape[3:]), device="cuda", dtype=DTYPE)
    moved = 2 * staging.numel() * staging.element_size()
    gather_ms = time_ms(lambda: gather_blocks(kv_cache, ids, staging))
    scatter_ms = time_ms(lambda: scatter_blocks(staging, kv_cache, ids))
    return [
        Figure(f"gather {num_ids} blocks (2 MiB)", moved / gather_ms / 1e6, "GB/s", copy_peak,
               "copy"),
        Figure(f"scatter {num_ids} blocks (2 MiB)", moved / scatter_ms / 1e6, "GB/s", copy_peak,
               "copy"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device; none found, nothing measured.")
        return 1
    sys.stdout.reconfigure(line_buffering=True)  # a long run: each line shows as it is printed
    torch.manual_seed(0)
    copy_peak, matmul_peak = copy_peak_gbs(), matmul_peak_tflops()
    device = f"{torch.cuda.get_device_name()} (cc {'.'.join(map(str, torch.cuda.get_device_capability()))})"
    print(f"device {device}: copy peak {copy_peak:.1f} GB/s, bf16 matmul peak {matmul_peak:.1f} TFLOP/s")
    figures = [bench_decode(copy_peak), bench_decode(copy_peak, block_size=128),
               *bench_block_copy(copy_peak)]
    for figure in figures:
        print(figure.line())
    report = {"device": device, "figures": [{**asdict(f), "ratio": f.ratio} for f in figures]}
    write_json(opts.json, report)
    all_res = bench_prefill(matmul_peak)
    report["prefill"] = prefill_rows(all_res, matmul_peak)
    write_json(opts.json, report)
    return 0


def write_json(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
