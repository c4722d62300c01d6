"""Prefill attention side by side, on the same shapes and in the same run (needs CUDA):

- `ours, N-token pages`: our paged prefill kernel (one query head per tile) with its default launch
  config for that block size: 16-token pages gather each key row through the block table;
  128-token pages (Hopper and newer) load whole tiles by TMA;
- `sdpa-flash`, `sdpa-cudnn`: torch SDPA restricted to one backend, dense, KV heads expanded
  with repeat_interleave (a 2k chunk over a cache: flash's causal is lower-right aligned; cuDNN
  gets a boolean lower-right mask).

Every figure is causal TFLOP/s (4 * head_dim * q_heads per visible (row, key) pair), its share
of the bf16 matmul peak measured in the run, and its ratio to cuDNN. Before any timing our kernel
is checked against `paged_attention_ref` on a small batch (PASS/FAIL; on FAIL nothing is timed),
and each peer against our kernel on the shape it is timed on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton.testing
from tieredkv.kernels import paged_attention_prefill as tiled
from tieredkv.kernels.paged_attention import paged_attention_ref
from torch.nn.attention import SDPBackend, sdpa_kernel

Inputs = tuple[torch.Tensor, ...]

OURS = "ours"
PAGE_SIZES = (16, 128)  # a gathered-row and a whole-tile (TMA) block size
PEER_TOLERANCE = 2e-2  # bf16: our kernel further than this from the reference, or a peer from ours, is not timed


@dataclass(frozen=True)
class Shape:
    """A prefill batch: q_lens new rows on contexts ctx_lens (the last q_len keys are new)."""

    name: str
    q_lens: list[int]
    ctx_lens: list[int]


@dataclass
class Result:
    variant: str
    config: str
    tflops: float | None  # None: not timed (failed check, unsupported, error)
    note: str = ""


@dataclass
class ShapeResults:
    shape: Shape
    flops: float
    results: list[Result] = field(default_factory=list)

    def best(self, prefix: str) -> Result | None:
        timed = [r for r in self.results if r.variant.startswith(prefix) and r.tflops]
        return max(timed, key=lambda r: r.tflops, default=None)


def shapes(long_contexts: tuple[int, ...], chunk: int) -> list[Shape]:
    out = [Shape(f"{n // 1024}k whole prompt", [n], [n]) for n in long_contexts]
    out += [Shape(f"{chunk // 1024}k chunk, ctx {n // 1024}k", [chunk], [n]) for n in long_contexts]
    return [*out, Shape("4 x 4k whole prompts", [4096] * 4, [4096] * 4)]


def causal_flops(q_lens: list[int], ctx_lens: list[int], q_heads: int, head_dim: int) -> float:
    """QK^T and PV flops: 4 * head_dim per visible (row, key) pair, per query head."""
    pairs = sum(q * (c - q) + q * (q + 1) / 2 for q, c in zip(q_lens, ctx_lens, strict=True))
    return 4 * head_dim * q_heads * pairs


def ours_name(page: int) -> str:
    return f"{OURS}, {page}-token pages"


def config_label(cfg: dict[str, int]) -> str:
    """A launch config of our kernel, in short ("TMA BM128 BN64 w4 s3")."""
    path = "TMA" if cfg.get("paged_tma") else "gathered"
    return f"{path} BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def config_name(query: torch.Tensor, page: int) -> str:
    """Our kernel's default launch config for this batch and block size, in short."""
    return config_label(tiled.config_for(query, page))


def error_of_ours(make_inputs: Callable[..., Inputs], scale: float, page: int,
                  config: dict[str, int] | None = None) -> tuple[float, str]:
    """Our kernel (at `config`, default: its own choice) on a small odd batch (decode rows, chunks
    starting inside a block) against paged_attention_ref: (max |error|, NaN for a NaN output;
    its config, in short)."""
    args = make_inputs([300, 1, 77, 1000], [1000, 500, 77, 1333], block_size=page)
    out = torch.full_like(args[0], float("nan"))
    tiled.prefill_attention(*args, out, scale, None, config=config)
    err = (out.float() - paged_attention_ref(*args, scale).float()).abs().max().item()
    return err, config_label(config) if config else config_name(args[0], page)


def check_ours(make_inputs: Callable[..., Inputs], scale: float) -> bool:
    """`error_of_ours` at each page size within PEER_TOLERANCE? Prints PASS/FAIL per page size."""
    ok = True
    for page in PAGE_SIZES:
        err, config = error_of_ours(make_inputs, scale, page)
        passed = err <= PEER_TOLERANCE  # False for NaN
        print(f"  check {ours_name(page):<24} {config:<30} max|err| {err:.2e}  {'PASS' if passed else 'FAIL'}")
        ok &= passed
    return ok


def bench_ms(fn: Callable[[], object]) -> float:
    """Median device milliseconds of `fn` (triton's do_bench: L2 flushed between calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def dense_peers(args: Inputs, shape: Shape, scale: float) -> dict[str, Callable[[], torch.Tensor]]:
    """SDPA calls on dense copies of one shape's inputs ([B, heads, L, d], KV heads expanded)."""
    query, k_cache, v_cache, tables, _, _ = args
    q_len, ctx, batch = shape.q_lens[0], shape.ctx_lens[0], len(shape.q_lens)
    assert shape.q_lens == [q_len] * batch and shape.ctx_lens == [ctx] * batch, "dense peers need equal sequences"
    group = query.shape[1] // k_cache.shape[2]
    blocks = math.ceil(ctx / k_cache.shape[1])

    def dense(cache: torch.Tensor) -> torch.Tensor:
        kv = cache[tables[:, :blocks].long()].flatten(1, 2)[:, :ctx]  # [B, ctx, kv_heads, d]
        return kv.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()

    q = query.view(batch, q_len, *query.shape[1:]).transpose(1, 2).contiguous()
    k, v = dense(k_cache), dense(v_cache)
    if q_len == ctx:
        def sdpa(backend: SDPBackend) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            return call
        return {"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    # a chunk over a cache: row i sees keys <= ctx - q_len + i (lower-right causal)
    mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len)

    def flash() -> torch.Tensor:  # flash's is_causal is lower-right when q_len < ctx
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]

    def cudnn(causal: bool) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:  # is_causal: checked against ours, timed only if lower-right
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if causal else mask, is_causal=causal, scale=scale)
        return call
    return {"sdpa-flash": flash, "sdpa-cudnn (is_causal)": cudnn(True), "sdpa-cudnn (bool mask)": cudnn(False)}


def measure_shape(shape: Shape, make_inputs: Callable, scale: float, flops: float) -> ShapeResults:
    """Time our kernel, then the SDPA backends, checking each peer's output against ours
    (max |diff| in the note)."""
    res = ShapeResults(shape, flops)
    for page in PAGE_SIZES:
        args = make_inputs(shape.q_lens, shape.ctx_lens, block_size=page)
        out = torch.empty_like(args[0])
        ms = bench_ms(functools.partial(tiled.prefill_attention, *args, out, scale, None))
        res.results.append(Result(ours_name(page), config_name(args[0], page), flops / ms / 1e9))
    # every timed call wrote our output into `out`: the peers are checked against the last
    ours = out.view(len(shape.q_lens), shape.q_lens[0], *out.shape[1:]).transpose(1, 2).float()
    for name, call in dense_peers(args, shape, scale).items():
        try:
            diff = (call().float() - ours).abs().max().item()
            if not diff <= PEER_TOLERANCE:  # NaN too: a mask aligned the other way, say
                res.results.append(Result(name, "dense", None, f"not timed: max|diff| vs ours {diff:.1e}"))
                continue
            ms = bench_ms(call)
            res.results.append(Result(name, "dense", flops / ms / 1e9, f"max|diff| vs ours {diff:.1e}"))
        except Exception as exc:  # backend refuses the shape / mask on this build
            res.results.append(Result(name, "dense", None, f"n/a ({type(exc).__name__}: {str(exc)[:80]})"))
        torch.cuda.empty_cache()
    return res


def print_shape(res: ShapeResults, peak: float) -> None:
    """Each variant's line: TFLOP/s, share of the matmul peak, ratio to the best cuDNN figure."""
    cudnn = res.best("sdpa-cudnn")
    print(f"== {res.shape.name}: {res.flops / 1e12:.2f} TFLOP causal")
    for r in res.results:
        if r.tflops is None:
            print(f"  {r.variant:<24} {r.config:<30} {'-':>8}                         {r.note}")
            continue
        vs = f"{r.tflops / cudnn.tflops:5.2f}x cuDNN" if cudnn else "   - x cuDNN"
        print(f"  {r.variant:<24} {r.config:<30} {r.tflops:6.1f} TFLOP/s {r.tflops / peak:6.1%} of mm  {vs}  {r.note}")


def print_summary(all_res: list[ShapeResults], peak: float) -> None:
    """One line per shape: ours at each page size, flash, cuDNN (% of the matmul peak), and each
    of ours / cuDNN."""
    pages = [ours_name(p) for p in PAGE_SIZES]
    print(f"\nsummary (% of bf16 matmul peak {peak:.1f} TFLOP/s)")
    print(f"{'shape':<24} " + " ".join(f"{f'ours b{p}':>9}" for p in PAGE_SIZES)
          + f" {'flash':>6} {'cudnn':>6}  " + " ".join(f"{f'b{p}/cudnn':>10}" for p in PAGE_SIZES))
    for res in all_res:
        ours = [res.best(name) for name in pages]
        flash, cudnn = res.best("sdpa-flash"), res.best("sdpa-cudnn")

        def pct(r: Result | None) -> str:
            return f"{r.tflops / peak:.1%}" if r else "-"
        ratios = [f"{r.tflops / cudnn.tflops:.2f}x" if r and cudnn else "-" for r in ours]
        print(f"{res.shape.name:<24} " + " ".join(f"{pct(r):>9}" for r in ours)
              + f" {pct(flash):>6} {pct(cudnn):>6}  " + " ".join(f"{r:>10}" for r in ratios))
