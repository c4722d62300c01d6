"""Kernel tests: every Triton kernel against its plain-torch reference on odd shapes, every
reference against an independent computation, and the wrappers' argument errors.

With a GPU the compiled kernels run on CUDA (the `gpu` tests add realistic sizes). Without one
they run in Triton's interpreter, which must be chosen before `triton` is first imported:
`@triton.jit` reads TRITON_INTERPRET when it decorates, and triton.language's own helpers
(tl.zeros, tl.max, ...) are decorated when triton is imported. This file sets the variable before
its imports, which is enough when it is imported first (`--noconftest`, or TRITON_INTERPRET=1 in
the shell). In a normal session conftest.py has already imported triton (through transformers),
so the in-process tests skip and `test_kernels_in_interpreter_child_process` re-runs this file in
a child pytest that has TRITON_INTERPRET=1 from the start.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.language as tl  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)
from triton.runtime import interpreter  # noqa: E402

INTERPRETED = isinstance(tl.zeros, interpreter.InterpretedFunction)
RUNS_HERE = HAS_CUDA or INTERPRETED  # else only the child-process runner below runs
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _patch_interpreter_bf16_dot() -> None:
    """Triton's interpreter (3.9) multiplies bf16 tl.dot operands as their raw uint16 bits.

    Widen them to float32 first (exact), as the GPU's bf16 MMA effectively does.
    """
    original = interpreter.InterpreterBuilder.create_dot
    if getattr(original, "widens_bf16", False):
        return

    def widen(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype == tl.bfloat16 and h.data.dtype == np.uint16:
            bits = h.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, *args):
        return original(self, widen(a), widen(b), d, *args)

    create_dot.widens_bf16 = True
    interpreter.InterpreterBuilder.create_dot = create_dot


def _patch_interpreter_bf16_rounding() -> None:
    """Triton's interpreter (3.9) truncates float32 -> bfloat16 casts.

    Round to nearest even instead, as the GPU's conversion (cvt.rn.bf16.f32) and torch do.
    """
    original = interpreter.InterpreterBuilder.cast_impl
    if getattr(original, "rounds_bf16", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        data = np.asarray(src.data, dtype=np.float32)
        bits = data.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = np.where(np.isnan(data), (bits >> 16) | 0x40, rounded)  # NaN stays NaN
        return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)

    cast_impl.rounds_bf16 = True
    interpreter.InterpreterBuilder.cast_impl = cast_impl


if INTERPRETED:
    _patch_interpreter_bf16_dot()
    _patch_interpreter_bf16_rounding()

# Modules, not the functions that tieredkv.kernels re-exports under the same names.
checks = importlib.import_module("tieredkv.kernels._checks")
kv_store = importlib.import_module("tieredkv.kernels.kv_store")
block_copy = importlib.import_module("tieredkv.kernels.block_copy")
pa = importlib.import_module("tieredkv.kernels.paged_attention")
pa_decode = importlib.import_module("tieredkv.kernels.paged_attention_decode")
pa_prefill = importlib.import_module("tieredkv.kernels.paged_attention_prefill")
rms_norm = importlib.import_module("tieredkv.kernels.rms_norm")
rotary = importlib.import_module("tieredkv.kernels.rotary")
silu_mul = importlib.import_module("tieredkv.kernels.silu_mul")


@pytest.fixture(autouse=True)
def _kernels_runnable(request: pytest.FixtureRequest) -> None:
    if not RUNS_HERE and request.function is not test_kernels_in_interpreter_child_process:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; "
                    "test_kernels_in_interpreter_child_process runs these tests")


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests run in this process")
def test_kernels_in_interpreter_child_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-rs", "--noconftest",
           "-p", "no:cacheprovider"]
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                           cwd=Path(__file__).parent.parent)
    report = child.stdout[-6000:] + child.stderr[-2000:]
    assert child.returncode == 0, f"kernel tests failed in the interpreter:\n{report}"
    assert " passed" in child.stdout, report
    assert "TRITON_INTERPRET=1 could be set" not in child.stdout, f"not interpreted:\n{report}"


ATOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# ---------------------------------------------------------------------------------------------
# Batches for attention


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    seed: int = 0,
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor], list[torch.Tensor]]:
    """Paged attention inputs plus each sequence's dense K and V ([ctx, kv_heads, head_dim]).

    Blocks are shuffled across the cache; slots past a sequence's context, unused table entries
    (pointing at a spare block) and the spare block hold NaN, so reading them shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    tables = torch.full((len(q_lens), max(blocks) + 1), num_blocks - 1, dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for b, ctx in enumerate(ctx_lens):
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        ids = perm[used : used + blocks[b]]
        used += blocks[b]
        tables[b, : blocks[b]] = ids.to(torch.int32)
        k_cache.view(-1, kv_heads, head_dim)[_slots(ids, ctx, block_size)] = k
        v_cache.view(-1, kv_heads, head_dim)[_slots(ids, ctx, block_size)] = v
        dense_k.append(k.to(device))
        dense_v.append(v.to(device))
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    args = tuple(t.to(device) for t in (query, k_cache, v_cache, tables, cu, ctx))
    return args, dense_k, dense_v


def _slots(block_ids: torch.Tensor, ctx: int, block_size: int) -> torch.Tensor:
    """Cache slot of key positions 0..ctx-1 for a sequence owning `block_ids`."""
    pos = torch.arange(ctx)
    return block_ids[pos // block_size] * block_size + pos % block_size


def dense_attention(
    query: torch.Tensor,
    cu: list[int],
    ctx_lens: list[int],
    dense_k: list[torch.Tensor],
    dense_v: list[torch.Tensor],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Independent check of the reference: SDPA per sequence with an explicit bool mask."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    heads = query.shape[1]
    for b, ctx in enumerate(ctx_lens):
        start, end = cu[b], cu[b + 1]
        if start == end:
            continue
        group = heads // dense_k[b].shape[1]
        q = query[start:end].double().transpose(0, 1)  # [heads, q_len, d]
        k = dense_k[b].double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = dense_v[b].double().repeat_interleave(group, dim=1).transpose(0, 1)
        pos = torch.arange(ctx - (end - start), ctx, device=query.device)[:, None]
        key = torch.arange(ctx, device=query.device)[None, :]
        mask = (key <= pos) & (key > pos - window if window else True)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


# (q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype, window)
ATTENTION_CASES = {
    "prefill": ([5, 17], [5, 17], 4, 4, 32, 16, torch.float32, None),
    "prefix_and_empty": ([3, 0, 20], [40, 9, 37], 4, 2, 16, 8, torch.bfloat16, None),
    "decode_gqa4": ([1, 1, 1, 1], [1, 19, 33, 70], 8, 2, 64, 16, torch.float16, None),
    "mixed_gqa4": ([1, 0, 6, 1], [50, 3, 30, 17], 4, 1, 32, 4, torch.bfloat16, None),
    "window": ([7, 1, 12], [40, 25, 12], 4, 2, 32, 8, torch.float16, 5),
    "decode_window": ([1, 1, 1], [3, 70, 45], 4, 4, 16, 16, torch.float32, 20),
    "uneven_rows": ([0, 2, 1], [4, 30, 66], 4, 2, 32, 16, torch.bfloat16, None),
}


def _case(name: str, device: str = DEVICE):
    q_lens, ctxs, heads, kv_heads, head_dim, block_size, dtype, window = ATTENTION_CASES[name]
    args, dense_k, dense_v = make_batch(
        q_lens, ctxs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=device,
    )
    return args, dense_k, dense_v, head_dim**-0.5, window


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = ATOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_paged_attention_ref_matches_dense_sdpa(name: str) -> None:
    args, dense_k, dense_v, scale, window = _case(name, "cpu")
    ref = pa.paged_attention_ref(*args, scale, window)
    dense = dense_attention(args[0], args[4].tolist(), args[5].tolist(), dense_k, dense_v,
                            scale, window)
    _assert_close(ref, dense.to(args[0].dtype), args[0].dtype)
    assert not ref.isnan().any()


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_paged_attention_matches_ref(name: str) -> None:
    """The public entry point (which dispatches on T <= B) against the reference."""
    args, _, _, scale, window = _case(name)
    out = pa.paged_attention(*args, scale, window)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    _assert_close(out, pa.paged_attention_ref(*args, scale, window), args[0].dtype)


@pytest.mark.parametrize(
    ("name", "num_splits"),
    [("decode_gqa4", 1), ("decode_gqa4", 4), ("decode_window", 2), ("uneven_rows", 2),
     ("mixed_gqa4", 1)],
)
def test_decode_kernel_any_batch(name: str, num_splits: int) -> None:
    """The split-K decode kernel is correct for any q_len, with one split or several."""
    args, _, _, scale, window = _case(name)
    out = torch.full_like(args[0], float("nan"))
    pa_decode.decode_attention(*args, out, scale, window, num_splits=num_splits)
    _assert_close(out, pa.paged_attention_ref(*args, scale, window), args[0].dtype)


@pytest.mark.parametrize(
    ("name", "num_splits"), [("mixed_gqa4", 2), ("window", 1), ("prefix_and_empty", 4)]
)
def test_mixed_batch_split_between_kernels(name: str, num_splits: int) -> None:
    """In a mixed batch each kernel writes exactly its own rows: q_len == 1 to decode."""
    args, _, _, scale, window = _case(name)
    q_lens = args[4].diff().tolist()
    single = torch.tensor([n == 1 for n in q_lens]).repeat_interleave(torch.tensor(q_lens))
    ref = pa.paged_attention_ref(*args, scale, window)
    for launch, mine in (
        (lambda o: pa_decode.decode_attention(*args, o, scale, window, single_row_seqs=True,
                                              num_splits=num_splits), single),
        (lambda o: pa_prefill.prefill_attention(*args, o, scale, window,
                                                skip_single_row_seqs=True), ~single),
    ):
        out = torch.full_like(args[0], float("nan"))
        launch(out)
        mine = mine.to(out.device)
        _assert_close(out[mine], ref[mine], args[0].dtype)
        assert out[~mine].isnan().all()


@pytest.mark.parametrize("name", ["decode_window", "uneven_rows"])
def test_prefill_kernel_on_decode_batches(name: str) -> None:
    """The tiled kernel (small tiles, so several per sequence) is correct on decode rows too."""
    args, _, _, scale, window = _case(name)
    out = torch.full_like(args[0], float("nan"))
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    pa_prefill.prefill_attention(*args, out, scale, window, config=config)
    _assert_close(out, pa.paged_attention_ref(*args, scale, window), args[0].dtype)


def test_prefill_kernel_small_tiles_long_prefix() -> None:
    """Several query tiles per sequence and unmasked key tiles before the diagonal band."""
    args, _, _ = make_batch([37, 1, 20], [90, 1, 53], heads=2, kv_heads=1, head_dim=16,
                            block_size=8, dtype=torch.float32)
    out = torch.full_like(args[0], float("nan"))
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    pa_prefill.prefill_attention(*args, out, 0.25, None, config=config)
    _assert_close(out, pa.paged_attention_ref(*args, 0.25, None), torch.float32)


PAGED_TMA_SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "paged_tma": True}


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype", "window"),
    [(4, 4, 16, torch.float32, None), (8, 2, 32, torch.bfloat16, None),
     (8, 1, 16, torch.float16, None), (8, 2, 16, torch.float32, 21)],
)
def test_prefill_paged_tma_matches_ref(heads: int, kv_heads: int, head_dim: int, dtype, window) -> None:
    """The paged TMA path (whole tiles loaded from pages; interpreted on CPU) on odd lengths: a
    whole prompt, chunks that start inside a page, a decode row and an empty sequence, GQA 1/4/8,
    and a sliding window (its tiles all masked, the query still by TMA); diagonal bands ending
    inside a tile (by masked loads) and on a tile's end (by TMA). Unused slots hold NaN, so a
    tile read past a sequence's keys shows."""
    q_lens, ctxs = [77, 37, 1, 0, 13, 64], [77, 100, 45, 9, 64, 96]
    args, _, _ = make_batch(q_lens, ctxs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            block_size=32, dtype=dtype)
    out = torch.full_like(args[0], float("nan"))
    pa_prefill.prefill_attention(*args, out, head_dim**-0.5, window, config=PAGED_TMA_SMALL)
    _assert_close(out, pa.paged_attention_ref(*args, head_dim**-0.5, window), dtype)


def test_prefill_paged_tma_needs_whole_tiles_per_page() -> None:
    args, _, _ = make_batch([20], [20], heads=2, kv_heads=1, head_dim=16, block_size=8,
                            dtype=torch.float32)
    out = torch.empty_like(args[0])
    with pytest.raises(ValueError, match=r"block_size \(8\) to be a multiple of BLOCK_N \(16\)"):
        pa_prefill.prefill_attention(*args, out, 0.25, None, config=PAGED_TMA_SMALL)


def test_paged_attention_ref_any_head_dim() -> None:
    args, dense_k, dense_v = make_batch([3, 1], [7, 5], heads=2, kv_heads=1, head_dim=24,
                                        block_size=4, dtype=torch.float32, device="cpu")
    ref = pa.paged_attention_ref(*args, 0.2)
    dense = dense_attention(args[0], [0, 3, 4], [7, 5], dense_k, dense_v, 0.2, None)
    _assert_close(ref, dense.float(), torch.float32)


def test_choose_num_splits() -> None:
    cpu = torch.device("cpu")  # counts as 4 SMs: splits until rows * kv_heads * splits >= 8
    assert pa_decode.choose_num_splits(1, 1, 8192, cpu) == 8
    assert pa_decode.choose_num_splits(1, 1, 1500, cpu) == 2
    assert pa_decode.choose_num_splits(1, 1, 1000, cpu) == 1
    assert pa_decode.choose_num_splits(64, 8, 8192, cpu) == 1
    assert pa_decode.choose_num_splits(1, 2, 100_000, cpu) == 4


# ---------------------------------------------------------------------------------------------
# store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_matches_ref(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 3 * 3 * 20, generator=gen).to(dtype).to(DEVICE)
    key = qkv[:, :60].view(9, 3, 20)  # strided rows, as a split of a fused projection
    value = qkv[:, 60:120].view(9, 3, 20)
    slots = torch.tensor([0, 7, -1, 34, 8, -5, 11, 3, 20], device=DEVICE)
    k_cache = torch.zeros(5, 7, 3, 20, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store.store_kv(key, value, k_cache, v_cache, slots)
    kv_store.store_kv_ref(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


def test_store_kv_ref_writes_exact_slots() -> None:
    key = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4) + 1
    k_cache = torch.zeros(3, 4, 2, 4)
    v_cache = torch.zeros(3, 4, 2, 4)
    kv_store.store_kv_ref(key, -key, k_cache, v_cache, torch.tensor([9, -1]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], -key[0])
    assert k_cache.count_nonzero() == key[0].numel()


# ---------------------------------------------------------------------------------------------
# gather_blocks / scatter_blocks

# (layers, num_blocks, block_size, kv_heads, head_dim): chunk sizes that are odd, smaller than a
# tile, and several tiles with a ragged end.
COPY_SHAPES = [(3, 11, 5, 3, 6), (2, 9, 16, 2, 64), (2, 5, 11, 3, 32)]


@pytest.mark.parametrize("shape", COPY_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("max_programs", [None, 3])  # 3: each program loops over several pieces
def test_gather_scatter_match_ref(shape: tuple[int, ...], dtype: torch.dtype, max_programs: int | None) -> None:
    layers, num_blocks, *rest = shape
    gen = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(layers, 2, num_blocks, *rest, generator=gen).to(dtype).to(DEVICE)
    ids = torch.tensor([3, 0, num_blocks - 1, 1], device=DEVICE)  # distinct: scatter is racy
    out = torch.full((4, layers, 2, *rest), float("nan"), dtype=dtype, device=DEVICE)
    expected = torch.empty_like(out)
    block_copy.gather_blocks(kv_cache, ids, out, max_programs)
    block_copy.gather_blocks_ref(kv_cache, ids, expected)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    src = torch.randn(out.shape, generator=gen).to(dtype).to(DEVICE)
    cache, cache_ref = kv_cache.clone(), kv_cache.clone()
    block_copy.scatter_blocks(src, cache, ids, max_programs)
    block_copy.scatter_blocks_ref(src, cache_ref, ids)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)


def test_block_copy_refs_move_exact_blocks() -> None:
    kv_cache = torch.randn(2, 2, 6, 3, 1, 4)
    ids = torch.tensor([5, 1])
    out = torch.empty(2, 2, 2, 3, 1, 4)
    block_copy.gather_blocks_ref(kv_cache, ids, out)
    for i, block in enumerate(ids.tolist()):
        for layer in range(2):
            for kv in range(2):
                assert torch.equal(out[i, layer, kv], kv_cache[layer, kv, block])
    restored = torch.zeros_like(kv_cache)
    block_copy.scatter_blocks_ref(out, restored, ids)
    assert torch.equal(restored[:, :, [5, 1]], kv_cache[:, :, [5, 1]])
    assert restored[:, :, [0, 2, 3, 4]].count_nonzero() == 0


def test_block_copy_is_bit_exact_for_nan_payloads() -> None:
    bits = torch.tensor([0x7FC01234, 0x7F800001, -1, 0x00000001], dtype=torch.int32)
    kv_cache = bits.repeat(1 * 2 * 3 * 2).view(1, 2, 3, 2, 1, 4).view(torch.float32).to(DEVICE)
    out = torch.zeros(1, 1, 2, 2, 1, 4, device=DEVICE)
    block_copy.gather_blocks(kv_cache, torch.tensor([2], device=DEVICE), out)
    assert torch.equal(out.view(torch.int32).cpu().flatten()[:4], bits)


# ---------------------------------------------------------------------------------------------
# rms_norm, apply_rotary, silu_mul: bit-exact with transformers' own ops

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Triton's and torch's float32 sums of squares round in different orders (rms_norm's module doc).
# A float32 output then moves by a few ulps (at most 5 seen in 2M outputs, in ~1 row in 5); in
# 16-bit the difference rarely survives the rounding of h, and then by one ulp of h times the
# weight: at most 2 ulps of the output. Inputs whose sums are exact in any order match bit for bit.
RMS_SUM_ORDER_RTOL_EPS = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}

# torch's CPU silu uses its own vectorized exp, a few float32 ulps from the correctly rounded one
# that the interpreter computes; on CUDA both sides call expf and must agree bit for bit. The
# rounding to 16 bits absorbs those ulps (no difference in 2M samples).
SILU_RTOL_EPS = {torch.float32: 0 if HAS_CUDA else 8, torch.float16: 0, torch.bfloat16: 0}


def _assert_bits(actual: torch.Tensor, expected: torch.Tensor, rtol_eps: int = 0) -> None:
    """Bit-exact, or (rtol_eps > 0) within rtol_eps * eps(dtype), relative, with atol 0."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if rtol_eps == 0:
        differ = (actual != expected).sum().item()
        assert torch.equal(actual, expected), f"{differ} of {actual.numel()} elements differ"
    else:
        rtol = rtol_eps * torch.finfo(actual.dtype).eps
        torch.testing.assert_close(actual, expected, atol=0, rtol=rtol)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps).to(x.device)
    norm.weight.data = weight  # keeps weight's dtype, which may differ from x's
    with torch.no_grad():
        return norm(x)


def _rms_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, *, exact_sums: bool, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """x and weight; with exact_sums, x holds k/16 for |k| <= 40, so every sum of squares (of
    up to 2**24 / 1600 terms) is exact in float32 in any order."""
    gen = torch.Generator().manual_seed(seed)
    if exact_sums:
        x = torch.randint(-40, 41, shape, generator=gen) / 16
    else:
        x = torch.randn(shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 5
    weight = torch.randn(shape[-1], generator=gen)
    return x.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE)


# 1, 5 and 17 rows (and a 3-d input); hidden sizes that are not powers of two
RMS_SHAPES = [(1, 96), (5, 48), (17, 96), (2, 3, 48)]


@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_bit_exact_when_sums_are_exact(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Mean, eps, rsqrt, both roundings and the weight product are torch's, bit for bit."""
    x, weight = _rms_inputs(shape, dtype, exact_sums=True)
    out = rms_norm.rms_norm(x, weight, 1e-6)
    assert out.is_contiguous()
    _assert_bits(out, rms_norm.rms_norm_ref(x, weight, 1e-6))
    _assert_bits(out, _hf_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("shape", RMS_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_random_within_sum_order(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, weight = _rms_inputs(shape, dtype, exact_sums=False)
    out = rms_norm.rms_norm(x, weight, 1e-5)
    for expected in (rms_norm.rms_norm_ref(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5)):
        _assert_bits(out, expected, RMS_SUM_ORDER_RTOL_EPS[dtype])
        assert (out == expected).float().mean() > 0.5  # only rows whose sums differ may differ


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_strided_heads_and_float32_weight(dtype: torch.dtype) -> None:
    """Qwen3's per-head q_norm on a [T, heads, head_dim] view of a fused projection."""
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randint(-40, 41, (17, 7 * 48), generator=gen) / 16).to(dtype).to(DEVICE)
    q = qkv[:, : 3 * 48].view(17, 3, 48)
    weight = torch.randn(48, generator=gen).to(dtype).to(DEVICE)
    out = rms_norm.rms_norm(q, weight, 1e-6)
    _assert_bits(out, _hf_rms_norm(q, weight, 1e-6))
    _assert_bits(out, rms_norm.rms_norm(q.contiguous(), weight, 1e-6))
    weight32 = weight.float() * 1.001  # float32 weight: the product is float32 (promotion)
    _assert_bits(rms_norm.rms_norm(q, weight32, 1e-6), _hf_rms_norm(q, weight32, 1e-6))


def test_row_layout_merges_leading_dims() -> None:
    fused = torch.zeros(5, 7 * 48)
    blocks = torch.zeros(2, 3, 4, 48)
    assert rms_norm.row_layout("x", torch.zeros(5, 48)) == (5, 1, 48, 0)
    assert rms_norm.row_layout("x", torch.zeros(2, 3, 48)) == (6, 1, 48, 0)
    assert rms_norm.row_layout("x", torch.zeros(4, 1, 48)) == (4, 1, 48, 0)
    assert rms_norm.row_layout("x", torch.zeros(48)) == (1, 1, 0, 0)
    assert rms_norm.row_layout("x", fused[:, : 3 * 48].view(5, 3, 48)) == (15, 3, 7 * 48, 48)
    assert rms_norm.row_layout("x", blocks[:, :, :2]) == (12, 2, 4 * 48, 48)
    with pytest.raises(ValueError, match="do not merge into two"):
        rms_norm.row_layout("x", blocks[:, :2, :2])


def _rotary_inputs(
    batch: int, seq_len: int, head_dim: int, dtype: torch.dtype, seed: int = 4
) -> tuple[torch.Tensor, ...]:
    """q [B, 6, T, D] and k [B, 2, T, D] as transposed views of one fused projection; cos
    [B, T, D] contiguous, sin broadcast over the batch (stride 0). Random cos/sin rather than a
    rope table, so that the two halves of a row differ."""
    gen = torch.Generator().manual_seed(seed)
    q_heads, k_heads = 6, 2
    qkv = torch.randn(batch, seq_len, (q_heads + 2 * k_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)
    q = qkv[..., : q_heads * head_dim].view(batch, seq_len, q_heads, head_dim).transpose(1, 2)
    k = qkv[..., q_heads * head_dim : (q_heads + k_heads) * head_dim]
    k = k.view(batch, seq_len, k_heads, head_dim).transpose(1, 2)
    cos = (torch.rand(batch, seq_len, head_dim, generator=gen) * 2 - 1).to(dtype).to(DEVICE)
    sin = (torch.rand(1, seq_len, head_dim, generator=gen) * 2 - 1).to(dtype).to(DEVICE)
    return q, k, cos, sin.expand(batch, -1, -1)


@pytest.mark.parametrize(("batch", "seq_len", "head_dim"), [(2, 5, 64), (1, 17, 128), (3, 1, 64)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_apply_rotary_bit_exact(
    batch: int, seq_len: int, head_dim: int, dtype: torch.dtype
) -> None:
    q, k, cos, sin = _rotary_inputs(batch, seq_len, head_dim, dtype)
    q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
    assert q_out.transpose(1, 2).is_contiguous() and k_out.transpose(1, 2).is_contiguous()
    for q_expected, k_expected in (rotary.apply_rotary_ref(q, k, cos, sin),
                                   apply_rotary_pos_emb(q, k, cos, sin)):
        _assert_bits(q_out, q_expected)
        _assert_bits(k_out, k_expected)


@pytest.mark.parametrize("shape", [(1, 96), (5, 48), (17, 96), (2, 3, 48)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp(100) is inf
def test_silu_mul_bit_exact(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """gate and up are the halves of a fused gate_up projection (strided rows)."""
    gen = torch.Generator().manual_seed(6)
    *lead, inter = shape
    gate_up = (torch.randn(*lead, 2 * inter, generator=gen) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    gate[..., :3] = torch.tensor([-100.0, 90.0, -20.0])  # exp overflows, underflows, is large
    out = silu_mul.silu_mul(gate, up)
    assert out.is_contiguous()
    _assert_bits(out, silu_mul.silu_mul_ref(gate, up), SILU_RTOL_EPS[dtype])
    _assert_bits(out, F.silu(gate) * up, SILU_RTOL_EPS[dtype])


# ---------------------------------------------------------------------------------------------
# Argument errors


def _attention_args() -> tuple[torch.Tensor, ...]:
    args, _, _ = make_batch([2, 1], [5, 3], heads=4, kv_heads=2, head_dim=16, block_size=4,
                            dtype=torch.float32)
    return args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {3: a[3].long()}, "block_tables has dtype"),
        (lambda a: {0: a[0][:, :3]}, "not a multiple"),
        (lambda a: {1: a[1][:, :, :, :8], 2: a[2][:, :, :, :8]}, "head_dim 8 does not match"),
        (lambda a: {2: a[2].half()}, "v_cache has dtype"),
        (lambda a: {4: a[4][:2]}, "cu_seqlens_q has shape"),
        (lambda a: {0: a[0].int()}, "query has dtype"),
    ],
)
def test_paged_attention_rejects_bad_arguments(change, message: str) -> None:
    args = list(_attention_args())
    for i, tensor in change(args).items():
        args[i] = tensor
    with pytest.raises(ValueError, match=message):
        pa.paged_attention(*args, 0.25)


def test_paged_attention_rejects_bad_head_dim_and_window() -> None:
    args, _, _ = make_batch([1], [3], heads=2, kv_heads=1, head_dim=24, block_size=4,
                            dtype=torch.float32)
    with pytest.raises(ValueError, match="power of"):
        pa.paged_attention(*args, 0.2)
    with pytest.raises(ValueError, match="sliding_window"):
        pa.paged_attention(*_attention_args(), 0.2, sliding_window=0)


def test_paged_attention_rejects_non_contiguous_cache() -> None:
    args = list(_attention_args())
    wide = torch.zeros(*args[1].shape[:3], 32, device=DEVICE)
    args[1] = wide[..., :16]
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        pa.paged_attention(*args, 0.25)


def test_paged_attention_ref_rejects_bad_values() -> None:
    args = list(_attention_args())
    args[5] = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)  # 1 < q_len 2
    with pytest.raises(ValueError, match="context_lens 1 < its 2 query rows"):
        pa.paged_attention_ref(*args, 0.25)


def test_store_kv_rejects_bad_arguments() -> None:
    key = torch.zeros(3, 2, 8, device=DEVICE)
    cache = torch.zeros(4, 4, 2, 8, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping has dtype"):
        kv_store.store_kv(key, key, cache, cache.clone(), slots.int())
    with pytest.raises(ValueError, match="value has shape"):
        kv_store.store_kv(key, key[:2], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        kv_store.store_kv(key, key, cache.transpose(0, 1), cache.clone(), slots)
    small = cache[..., :4].contiguous()
    with pytest.raises(ValueError, match="k_cache has shape"):
        kv_store.store_kv(key, key, small, small.clone(), slots)
    with pytest.raises(ValueError, match="v_cache has dtype"):
        kv_store.store_kv(key, key, cache, cache.half(), slots)


def test_block_copy_rejects_bad_arguments() -> None:
    kv_cache = torch.zeros(2, 2, 5, 4, 1, 8, device=DEVICE)
    ids = torch.tensor([1, 3], device=DEVICE)
    out = torch.zeros(2, 2, 2, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="block_ids has dtype"):
        block_copy.gather_blocks(kv_cache, ids.int(), out)
    with pytest.raises(ValueError, match=r"out has shape \(3, 2, 2, 4, 1, 8\)"):
        block_copy.gather_blocks(kv_cache, ids, torch.zeros(3, 2, 2, 4, 1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="src has dtype"):
        block_copy.scatter_blocks(out.half(), kv_cache, ids)
    wide = torch.zeros(2, 2, 5, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        block_copy.gather_blocks(wide[..., :8], ids, out)


def test_rms_norm_rejects_bad_arguments() -> None:
    x = torch.zeros(3, 4, 48, device=DEVICE)
    weight = torch.ones(48, device=DEVICE)
    with pytest.raises(ValueError, match="x has dtype"):
        rms_norm.rms_norm(x.int(), weight, 1e-6)
    with pytest.raises(ValueError, match=r"weight has shape \(40,\)"):
        rms_norm.rms_norm(x, weight[:40], 1e-6)
    with pytest.raises(ValueError, match="x needs a contiguous last dim"):
        rms_norm.rms_norm(x.transpose(1, 2), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="do not merge into two"):
        rms_norm.rms_norm(torch.zeros(2, 3, 4, 48, device=DEVICE)[:, :2, :2], weight, 1e-6)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        rms_norm.rms_norm(x, torch.ones(48, device="meta"), 1e-6)


def test_apply_rotary_rejects_bad_arguments() -> None:
    q, k, cos, sin = _rotary_inputs(1, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="head_dim 63 is odd"):
        rotary.apply_rotary(q[..., :63], k[..., :63], cos[..., :63], sin[..., :63])
    with pytest.raises(ValueError, match=r"k has shape \(1, 2, 2, 64\)"):
        rotary.apply_rotary(q, k[:, :, :2], cos, sin)
    with pytest.raises(ValueError, match="cos has dtype"):
        rotary.apply_rotary(q, k, cos.half(), sin)
    with pytest.raises(ValueError, match=r"sin has shape \(1, 3, 32\)"):
        rotary.apply_rotary(q, k, cos, sin[..., :32])
    with pytest.raises(ValueError, match="q must have 4 dims"):
        rotary.apply_rotary(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="q needs a contiguous last dim"):
        rotary.apply_rotary(torch.zeros(1, 6, 3, 128, device=DEVICE)[..., ::2], k, cos, sin)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        rotary.apply_rotary(q, k, cos, sin.to("meta"))


def test_silu_mul_rejects_bad_arguments() -> None:
    gate = torch.zeros(3, 48, device=DEVICE)
    with pytest.raises(ValueError, match=r"up has shape \(3, 40\)"):
        silu_mul.silu_mul(gate, gate[:, :40])
    with pytest.raises(ValueError, match="up has dtype"):
        silu_mul.silu_mul(gate, gate.half())
    with pytest.raises(ValueError, match="gate has dtype"):
        silu_mul.silu_mul(gate.long(), gate.long())
    with pytest.raises(ValueError, match="gate needs a contiguous last dim"):
        silu_mul.silu_mul(gate.t(), gate.t().contiguous())


def test_cpu_tensors_without_interpreter_point_to_ref() -> None:
    with pytest.raises(ValueError, match="call store_kv_ref instead"):
        checks.check_launchable("store_kv", torch.device("cpu"), object())


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes (Llama-3-8B attention: 32 heads, 8 kv heads, head_dim 128, block 16)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window", [None, 4096])
def test_gpu_decode_llama3_8b(dtype: torch.dtype, window: int | None) -> None:
    ctxs = [8192, 1, 5000, 333, 8191, 17, 4096, 2049]
    args, _, _ = make_batch([1] * 8, ctxs, heads=32, kv_heads=8, head_dim=128, block_size=16,
                            dtype=dtype, device="cuda")
    out = pa.paged_attention(*args, 128**-0.5, window)
    _assert_close(out, pa.paged_attention_ref(*args, 128**-0.5, window), dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_prefill_llama3_8b(dtype: torch.dtype, window: int | None) -> None:
    q_lens, ctxs = [2048, 1, 0, 1500, 300], [2048, 8000, 10, 8192, 300]
    args, _, _ = make_batch(q_lens, ctxs, heads=32, kv_heads=8, head_dim=128, block_size=16,
                            dtype=dtype, device="cuda")
    out = pa.paged_attention(*args, 128**-0.5, window)
    _assert_close(out, pa.paged_attention_ref(*args, 128**-0.5, window), dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("kv_heads", [32, 8, 4])  # GQA 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("block_size", "window"), [(64, None), (128, None), (128, 1000)])
def test_gpu_prefill_paged_tma(kv_heads: int, head_dim: int, block_size: int, window: int | None) -> None:
    """Pages of whole tiles: the default config takes the paged TMA path on Hopper and newer;
    odd lengths, chunks starting inside a page, decode rows and an empty sequence in one batch;
    a sliding window too."""
    q_lens, ctxs = [2048, 1, 0, 1500, 300, 77, 1000], [2048, 8000, 10, 8192, 300, 4097, 1063]
    args, _, _ = make_batch(q_lens, ctxs, heads=32, kv_heads=kv_heads, head_dim=head_dim,
                            block_size=block_size, dtype=torch.bfloat16, device="cuda")
    if torch.cuda.get_device_capability()[0] >= 9:
        assert pa_prefill.config_for(args[0], block_size).get("paged_tma")
    out = pa.paged_attention(*args, head_dim**-0.5, window)
    _assert_close(out, pa.paged_attention_ref(*args, head_dim**-0.5, window), torch.bfloat16)


def _tuned_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: dict) -> None:
    path = tmp_path / "prefill_tuned.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(pa_prefill, "TUNED_CONFIGS", path)
    pa_prefill.tuned_config.cache_clear()


def test_tuned_prefill_config_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config tuned for a GPU kind is found by device name, dtype and head size, and only there."""
    tuned = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}
    _tuned_file(tmp_path, monkeypatch, {"NVIDIA H200": {"bfloat16/128": {"config": tuned}}})
    try:
        assert pa_prefill.tuned_config("NVIDIA H200", torch.bfloat16, 128) == {**tuned, "paged_tma": True}
        assert pa_prefill.tuned_config("NVIDIA H200", torch.float16, 128) is None
        assert pa_prefill.tuned_config("NVIDIA H200", torch.bfloat16, 64) is None
        assert pa_prefill.tuned_config("NVIDIA H100 80GB HBM3", torch.bfloat16, 128) is None
        monkeypatch.setattr(pa_prefill, "TUNED_CONFIGS", tmp_path / "absent.json")
        pa_prefill.tuned_config.cache_clear()
        assert pa_prefill.tuned_config("NVIDIA H200", torch.bfloat16, 128) is None
    finally:
        pa_prefill.tuned_config.cache_clear()


def test_shipped_tuned_prefill_configs_are_launchable() -> None:
    """Every recorded config names the four launch options, with tiles the kernel can take."""
    if not pa_prefill.TUNED_CONFIGS.exists():
        pytest.skip("no tuned configs recorded")
    for device, entries in json.loads(pa_prefill.TUNED_CONFIGS.read_text()).items():
        for key, entry in entries.items():
            config = entry["config"]
            assert set(config) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}, (device, key)
            assert config["BLOCK_M"] in (64, 128) and config["BLOCK_N"] in (64, 128), (device, key)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [64, 128])
def test_gpu_prefill_tuned_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_size: int) -> None:
    """A config tuned for this GPU is what `config_for` launches where its tiles fit the pages
    (else the built-in one), and the kernel stays exact with it."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("paged TMA needs compute capability 9+")
    tuned = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    _tuned_file(tmp_path, monkeypatch, {torch.cuda.get_device_name(): {"bfloat16/128": {"config": tuned}}})
    try:
        q_lens, ctxs = [2048, 1, 1500, 77], [2048, 8000, 8192, 4097]
        args, _, _ = make_batch(q_lens, ctxs, heads=32, kv_heads=8, head_dim=128, block_size=block_size,
                                dtype=torch.bfloat16, device="cuda")
        want = {**tuned, "paged_tma": True} if block_size == 128 else pa_prefill.PAGED_TMA_CONFIG
        assert pa_prefill.config_for(args[0], block_size) == want
        out = pa.paged_attention(*args, 128**-0.5)
        _assert_close(out, pa.paged_attention_ref(*args, 128**-0.5), torch.bfloat16)
    finally:
        pa_prefill.tuned_config.cache_clear()


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 256])
def test_gpu_other_head_dims(head_dim: int) -> None:
    for q_lens, ctxs in (([1] * 4, [900, 31, 4000, 2]), ([300, 1], [700, 64])):
        args, _, _ = make_batch(q_lens, ctxs, heads=8, kv_heads=8, head_dim=head_dim,
                                block_size=16, dtype=torch.bfloat16, device="cuda")
        out = pa.paged_attention(*args, head_dim**-0.5)
        _assert_close(out, pa.paged_attention_ref(*args, head_dim**-0.5), torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_block_copy_llama3_8b() -> None:
    kv_cache = torch.randn(32, 2, 600, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(600, device="cuda")[:256]
    out = torch.empty(256, 32, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    expected = torch.empty_like(out)
    block_copy.gather_blocks(kv_cache, ids, out)
    block_copy.gather_blocks_ref(kv_cache, ids, expected)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    restored = torch.zeros_like(kv_cache)
    block_copy.scatter_blocks(out, restored, ids)
    torch.testing.assert_close(restored[:, :, ids], kv_cache[:, :, ids], rtol=0, atol=0)


@gpu
@needs_cuda
def test_gpu_store_kv_llama3_8b() -> None:
    key = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(600 * 16, device="cuda")[:4096]
    slots[::7] = -1
    caches = [torch.zeros(600, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    kv_store.store_kv(key, value, caches[0], caches[1], slots)
    kv_store.store_kv_ref(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [4096, 3584])  # Llama-3-8B; Qwen2.5-7B (1/H inexact)
def test_gpu_rms_norm_llama3_8b(dtype: torch.dtype, hidden: int) -> None:
    x, weight = _rms_inputs((4096, hidden), dtype, exact_sums=False)
    out = rms_norm.rms_norm(x, weight, 1e-5)
    _assert_bits(out, _hf_rms_norm(x, weight, 1e-5), RMS_SUM_ORDER_RTOL_EPS[dtype])
    x, weight = _rms_inputs((4096, hidden), dtype, exact_sums=True)
    _assert_bits(rms_norm.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5))
    heads = x[:, :2048].view(4096, 16, 128)  # per-head norm on a strided view
    _assert_bits(rms_norm.rms_norm(heads, weight[:128], 1e-6),
                 _hf_rms_norm(heads, weight[:128], 1e-6))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_apply_rotary_llama3_8b(dtype: torch.dtype) -> None:
    for batch, seq_len in ((1, 4096), (64, 1)):  # prefill, decode
        qkv = torch.randn(batch, seq_len, 48 * 128, device="cuda").to(dtype)
        q = qkv[..., : 32 * 128].view(batch, seq_len, 32, 128).transpose(1, 2)
        k = qkv[..., 32 * 128 : 40 * 128].view(batch, seq_len, 8, 128).transpose(1, 2)
        cos = (torch.rand(batch, seq_len, 128, device="cuda") * 2 - 1).to(dtype)
        sin = (torch.rand(batch, seq_len, 128, device="cuda") * 2 - 1).to(dtype)
        q_out, k_out = rotary.apply_rotary(q, k, cos, sin)
        q_expected, k_expected = apply_rotary_pos_emb(q, k, cos, sin)
        _assert_bits(q_out, q_expected)
        _assert_bits(k_out, k_expected)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_silu_mul_llama3_8b(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(4096, 2 * 14336, device="cuda") * 4).to(dtype)
    gate, up = gate_up[:, :14336], gate_up[:, 14336:]
    _assert_bits(silu_mul.silu_mul(gate, up), F.silu(gate) * up)
