"""Temporary tuning sweep (not a deliverable)."""
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import bench_kernels as bk  # noqa: E402

from tieredkv.kernels import block_copy, paged_attention_ref  # noqa: E402
from tieredkv.kernels import paged_attention_decode as dec  # noqa: E402
from tieredkv.kernels import paged_attention_prefill as pre  # noqa: E402

what = sys.argv[1:] or ["check", "decode", "copy", "prefill"]
torch.manual_seed(0)
copy_peak = bk.copy_peak_gbs()
mm_peak = bk.matmul_peak_tflops()
print(f"copy peak {copy_peak:.0f} GB/s  mm {mm_peak:.0f} TFLOP/s", flush=True)


def check():
    for q_lens, ctxs in (([1] * 8, [5000, 17, 1, 300, 8192, 33, 64, 1000]),
                         ([700, 0, 1, 300], [700, 5, 4000, 2000]),
                         ([1, 2, 0], [100, 900, 50])):
        args = bk.attention_inputs(q_lens, ctxs)
        for win in (None, 129):
            ref = paged_attention_ref(*args, 0.088, win).float()
            for name, fn in (
                ("dec1", lambda o: dec.decode_attention(*args, o, 0.088, win, num_splits=1)),
                ("dec4", lambda o: dec.decode_attention(*args, o, 0.088, win, num_splits=4)),
                ("pre", lambda o: pre.prefill_attention(*args, o, 0.088, win)),
            ):
                o = torch.full_like(args[0], float("nan"))
                fn(o)
                err = (o.float() - ref).abs().max().item()
                print(f"check {q_lens[:3]} win={win} {name}: max err {err:.4f}", flush=True)


def decode():
    args = bk.attention_inputs([1] * 64, [8192] * 64)
    kv_bytes = 2 * 64 * 8192 * 8 * 128 * 2
    res = []
    for bn in (16, 32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                for splits in (1, 2, 4):
                    cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                    o = torch.empty_like(args[0])
                    try:
                        ms = bk.time_ms(lambda: dec.decode_attention(
                            *args, o, 0.088, None, num_splits=splits, config=cfg), reps=7)
                    except Exception as e:  # noqa: BLE001
                        print("fail", cfg, splits, type(e).__name__, str(e)[:100])
                        continue
                    gbs = kv_bytes / ms / 1e6
                    res.append((gbs, cfg, splits))
                    print(f"decode {cfg} splits={splits}: {gbs:.0f} GB/s "
                          f"{gbs / copy_peak:.1%}", flush=True)
    res.sort(key=lambda r: -r[0])
    print("BEST decode", res[:5])


def copy():
    figs = []
    for tile in (4096, 8192, 16384, 32768, 65536):
        for warps in (4, 8, 16):
            block_copy._TILE_BYTES = tile
            block_copy._NUM_WARPS = warps
            figs = bk.bench_block_copy(copy_peak)
            print(f"copy tile={tile} warps={warps}: " + "  ".join(
                f"{f.value:.0f} GB/s {f.ratio:.1%}" for f in figs), flush=True)


def prefill():
    cases = (([4096] * 4, [4096] * 4), ([2048], [8192 + 2048]))
    for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                                  (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3),
                                  (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 2)):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        line = []
        for q_lens, ctxs in cases:
            args = bk.attention_inputs(q_lens, ctxs)
            o = torch.empty_like(args[0])
            try:
                ms = bk.time_ms(lambda: pre.prefill_attention(*args, o, 0.088, None, config=cfg),
                                reps=5)
            except Exception as e:  # noqa: BLE001
                line.append(f"fail {type(e).__name__} {str(e)[:80]}")
                continue
            fl = sum(bk.causal_flops(q, c) for q, c in zip(q_lens, ctxs))
            tf = fl / ms / 1e9
            line.append(f"{tf:.0f} TF {tf / mm_peak:.1%}")
        print(f"prefill {cfg}: " + "  ".join(line), flush=True)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _copy_exp(cache_ptr, staging_ptr, ids_ptr, num_cache_blocks,
              CPB: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, HINT: tl.constexpr,
              LOOP: tl.constexpr):
    j = tl.program_id(0)
    i = j // CPB
    lc = j % CPB
    block = tl.load(ids_ptr + i)
    cache = cache_ptr + (lc * num_cache_blocks + block) * CHUNK
    staging = staging_ptr + j.to(tl.int64) * CHUNK
    if LOOP:
        for k in tl.static_range(0, CHUNK, TILE):
            offs = k + tl.arange(0, TILE)
            if HINT:
                x = tl.load(cache + offs, eviction_policy="evict_first")
                tl.store(staging + offs, x, cache_modifier=".cs")
            else:
                tl.store(staging + offs, tl.load(cache + offs))
    else:
        offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
        if HINT:
            x = tl.load(cache + offs, eviction_policy="evict_first")
            tl.store(staging + offs, x, cache_modifier=".cs")
        else:
            tl.store(staging + offs, tl.load(cache + offs))


def copyexp():
    shape = (32, 2, 1024, 16, 8, 128)
    kv = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(1024, device="cuda")[:256]
    st = torch.empty((256, 32, 2, 16, 8, 128), device="cuda", dtype=torch.bfloat16)
    moved = 2 * st.numel() * 2
    ref = torch.empty_like(st)
    block_copy.gather_blocks_ref(kv, ids, ref)
    for view in (torch.int64, torch.int32):
        c = kv.view(32 * 2 * 1024, -1).view(view)
        s = st.view(256 * 64, -1).view(view)
        chunk = c.shape[1]
        for tile_b in (4096, 8192, 16384, 32768):
            tile = tile_b // c.element_size()
            for warps in (4, 8):
                for hint in (False, True):
                    for loop in (False, True):
                        grid = (s.shape[0],) if loop else (s.shape[0], chunk // tile)
                        st.zero_()
                        fn = lambda: _copy_exp[grid](c, s, ids, 1024, CPB=64, CHUNK=chunk,  # noqa: E731,B023
                                                     TILE=tile, HINT=hint, LOOP=loop,
                                                     num_warps=warps)
                        ms = bk.time_ms(fn)
                        ok = torch.equal(st, ref)
                        gbs = moved / ms / 1e6
                        print(f"copyexp {view} tile={tile_b} w={warps} hint={hint} loop={loop}:"
                              f" {gbs:.0f} GB/s {gbs / copy_peak:.1%} ok={ok}", flush=True)
    # torch baselines
    for name, fn in (("torch index_select dim2", lambda: torch.index_select(kv, 2, ids)),
                     ("torch copy 512MiB", lambda: ref.copy_(st))):
        ms = bk.time_ms(fn)
        print(f"{name}: {moved / ms / 1e6:.0f} GB/s", flush=True)


def prefill2():
    cases = (([4096] * 4, [4096] * 4), ([2048], [8192 + 2048]))
    for bm, bn, warps, stages in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
                                  (128, 32, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4)):
        for k_rows in (False, True):
            for rev in (False, True):
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
                       "K_ROWS": k_rows, "REVERSE": rev}
                line = []
                for q_lens, ctxs in cases:
                    args = bk.attention_inputs(q_lens, ctxs)
                    o = torch.empty_like(args[0])
                    ms = bk.time_ms(lambda: pre.prefill_attention(*args, o, 0.088, None,  # noqa: B023
                                                                  config=cfg), reps=5)
                    fl = sum(bk.causal_flops(q, c) for q, c in zip(q_lens, ctxs, strict=True))
                    tf = fl / ms / 1e9
                    line.append(f"{tf:.0f} TF {tf / mm_peak:.1%}")
                print(f"prefill2 {cfg}: " + "  ".join(line), flush=True)


def decode2():
    kv_bytes = 2 * 64 * 8192 * 8 * 128 * 2
    for batch, ctx in ((64, 8192), (8, 8192), (256, 1024)):
        args = bk.attention_inputs([1] * batch, [ctx] * batch)
        kv_bytes = 2 * batch * ctx * 8 * 128 * 2
        for k_rows in (False, True):
            for bn in (64, 128):
                for splits in (None, 1, 2, 4, 8):
                    cfg = {"BLOCK_N": bn, "num_warps": 4, "num_stages": 3, "K_ROWS": k_rows}
                    o = torch.empty_like(args[0])
                    ms = bk.time_ms(lambda: dec.decode_attention(  # noqa: B023
                        *args, o, 0.088, None, num_splits=splits, config=cfg), reps=7)  # noqa: B023
                    gbs = kv_bytes / ms / 1e6
                    print(f"decode2 b={batch} ctx={ctx} {cfg} splits={splits}: {gbs:.0f} GB/s "
                          f"{gbs / copy_peak:.1%}", flush=True)


def bench():
    import subprocess
    subprocess.run([sys.executable, "benchmarks/bench_kernels.py"], check=True)


if __name__ == "__main__":
    for w in what:
        t = time.time()
        globals()[w]()
        print(f"[{w} took {time.time() - t:.0f}s]", flush=True)
