"""Prefill attention side by side, on the same shapes and in the same run (needs CUDA):

- `tiled`: the current paged kernel (one query head per tile), its default launch config;
- `gqa`: the GQA-packed paged kernel over a sweep of launch configs (BLOCK_M tile rows, BLOCK_N
  keys, warps, stages), each printed, the best kept per shape; warp-specialized configs last;
- `sdpa-flash`, `sdpa-cudnn`: torch SDPA restricted to one backend, dense, KV heads expanded
  with repeat_interleave (a 2k chunk over a cache: flash's causal is lower-right aligned; cuDNN
  gets a boolean lower-right mask).

Every figure is causal TFLOP/s (4 * head_dim * q_heads per visible (row, key) pair), its share
of the bf16 matmul peak measured in the run, and its ratio to cuDNN. Before any timing, every
variant is checked against `paged_attention_ref` on a small batch (PASS/FAIL); a variant that
fails is not timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton.testing
from tieredkv.kernels import paged_attention_prefill as tiled
from tieredkv.kernels import paged_attention_prefill_gqa as gqa
from tieredkv.kernels.paged_attention import paged_attention_ref
from torch.nn.attention import SDPBackend, sdpa_kernel

Config = dict[str, int]
Inputs = tuple[torch.Tensor, ...]

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts tile rows (query rows x group)
GQA_SWEEP = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4),
             (64, 128, 4, 3), (64, 64, 4, 4), (256, 64, 8, 2), (128, 32, 4, 4)]
GQA_WARP_SPECIALIZED = [(128, 128, 8, 3), (128, 64, 4, 3)]
PEER_TOLERANCE = 2e-2  # bf16: a variant or peer further than this from the reference is not timed


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


def config_name(cfg: Config) -> str:
    ws = " ws" if cfg.get("WARP_SPECIALIZE") else ""
    return f"BM{cfg['BLOCK_M']} BN{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}{ws}"


def _as_config(t: tuple[int, int, int, int], warp_specialize: bool = False) -> Config:
    cfg = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), t, strict=True))
    return {**cfg, "WARP_SPECIALIZE": 1} if warp_specialize else cfg


def kernel_variants(dtype: torch.dtype, head_dim: int, warp_specialized: bool) -> list[tuple[str, Config, Callable]]:
    """(name, config, launcher) of our kernels: tiled default, then the GQA sweep."""
    if warp_specialized:
        return [("gqa", _as_config(t, True), gqa.prefill_attention_gqa) for t in GQA_WARP_SPECIALIZED]
    default = gqa.default_config(dtype, head_dim)
    sweep = [_as_config(t) for t in GQA_SWEEP]
    return [("tiled (current)", tiled.default_config(dtype, head_dim), tiled.prefill_attention),
            *(("gqa" + (" (default)" if c == default else ""), c, gqa.prefill_attention_gqa) for c in sweep)]


def check_variants(variants: list, make_inputs: Callable[[list[int], list[int]], Inputs],
                   scale: float) -> list:
    """Run each variant on a small odd batch (decode rows, chunks starting inside a block)
    against paged_attention_ref; print PASS/FAIL; return the variants that pass."""
    args = make_inputs([300, 1, 77, 1000], [1000, 500, 77, 1333])
    ref = paged_attention_ref(*args, scale).float()
    passed = []
    for name, cfg, launch in variants:
        out = torch.full_like(args[0], float("nan"))
        try:
            launch(*args, out, scale, None, config=cfg)
            err = (out.float() - ref).abs().max().item()
            ok = err <= PEER_TOLERANCE  # False for NaN
            print(f"  check {name:<18} {config_name(cfg):<24} max|err| {err:.2e}  {'PASS' if ok else 'FAIL'}")
        except Exception as exc:  # a config the compiler or the GPU cannot run (shared memory, ...)
            ok = False
            print(f"  check {name:<18} {config_name(cfg):<24} FAIL ({type(exc).__name__}: {str(exc)[:120]})")
        if ok:
            passed.append((name, cfg, launch))
    return passed


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


def measure_shape(shape: Shape, variants: list, make_inputs: Callable, scale: float, flops: float,
                  peers: bool) -> ShapeResults:
    """Time our variants, then (with `peers`) the SDPA backends, checking each peer's output
    against ours (max |diff| in the note)."""
    res = ShapeResults(shape, flops)
    args = make_inputs(shape.q_lens, shape.ctx_lens)
    out = torch.empty_like(args[0])
    for name, cfg, launch in variants:
        try:
            ms = bench_ms(lambda launch=launch, cfg=cfg: launch(*args, out, scale, None, config=cfg))
            res.results.append(Result(name, config_name(cfg), flops / ms / 1e9))
        except Exception as exc:
            res.results.append(Result(name, config_name(cfg), None, f"{type(exc).__name__}: {str(exc)[:80]}"))
    if not peers:
        return res
    tiled.prefill_attention(*args, out, scale, None)  # the current kernel's output, to check the peers
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


def print_shape(res: ShapeResults, peak: float, cudnn: Result | None = None) -> None:
    """Each variant's line; ratios to `cudnn` (default: the cuDNN figure among `res`)."""
    cudnn = cudnn or res.best("sdpa-cudnn")
    print(f"== {res.shape.name}: {res.flops / 1e12:.2f} TFLOP causal")
    for r in res.results:
        if r.tflops is None:
            print(f"  {r.variant:<24} {r.config:<24} {'-':>8}                         {r.note}")
            continue
        vs = f"{r.tflops / cudnn.tflops:5.2f}x cuDNN" if cudnn else "   - x cuDNN"
        print(f"  {r.variant:<24} {r.config:<24} {r.tflops:6.1f} TFLOP/s {r.tflops / peak:6.1%} of mm  {vs}  {r.note}")


def print_summary(all_res: list[ShapeResults], peak: float) -> None:
    """One line per shape: current, default GQA config, best GQA config, peers (% of peak)."""
    print(f"\nsummary (% of bf16 matmul peak {peak:.1f} TFLOP/s; x = ratio to cuDNN)")
    print(f"{'shape':<24} {'tiled':>7} {'gqa dflt':>8} {'gqa best':>8}  {'best config':<26} {'flash':>6} "
          f"{'cudnn':>6}  {'best/cudnn':>10} {'best/tiled':>10}")
    for res in all_res:
        current, best = res.best("tiled"), res.best("gqa")
        default, flash, cudnn = res.best("gqa (default)"), res.best("sdpa-flash"), res.best("sdpa-cudnn")

        def pct(r: Result | None) -> str:
            return f"{r.tflops / peak:.1%}" if r else "-"

        def ratio(a: Result | None, b: Result | None) -> str:
            return f"{a.tflops / b.tflops:.2f}x" if a and b else "-"
        print(f"{res.shape.name:<24} {pct(current):>7} {pct(default):>8} {pct(best):>8}  "
              f"{best.config if best else '-':<26} {pct(flash):>6} {pct(cudnn):>6}  "
              f"{ratio(best, cudnn):>10} {ratio(best, current):>10}")
    _print_best_overall(all_res)


def _print_best_overall(all_res: list[ShapeResults]) -> None:
    """The GQA config with the best geometric mean over all shapes (what a default should be)."""
    per_config: dict[str, list[float]] = {}
    for res in all_res:
        for r in res.results:
            if r.variant.startswith("gqa") and r.tflops:
                per_config.setdefault(r.config, []).append(r.tflops)
    complete = {c: v for c, v in per_config.items() if len(v) == len(all_res)}
    if not complete:
        return
    geo = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in complete.items()}
    ranked = sorted(geo.items(), key=lambda kv: -kv[1])
    print("gqa configs by geometric mean TFLOP/s over all shapes: "
          + ", ".join(f"{c} {t:.1f}" for c, t in ranked[:4]))
