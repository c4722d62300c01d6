"""Tune the paged TMA prefill kernel's launch config on this GPU (needs CUDA, compute capability 9+).

Sweeps tile sizes, warps and pipeline stages over the shapes serving runs (a long whole prompt, a
2k chunk over a long cached context, four 4k prompts; Llama-3-8B heads, bf16, 128-token pages),
checks each config against `paged_attention_ref` before timing it, and prints every config's
share of the bf16 matmul peak measured in the same run. The best by geometric mean over the shapes
wins; `--write` records it for this kind of GPU in the kernels' tuned-config file, where
`config_for` finds it, if it beats the built-in config by at least MIN_GAIN (two sweeps on one card
differ by about a point; the kernel keeps its built-in config on a GPU with no entry).

    python benchmarks/tune_prefill.py [--write] [--json results/tune.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import prefill_peers
import torch
import triton
from bench_kernels import CHUNK, DTYPE, HEAD_DIM, Q_HEADS, attention_inputs, matmul_peak_tflops
from prefill_peers import config_label
from tieredkv.kernels import paged_attention_prefill as tiled

PAGE = 128
MIN_GAIN = 0.02  # the geometric-mean gain over the built-in config that a recorded config must show
SHAPES = (
    prefill_peers.Shape("16k whole prompt", [16384], [16384]),
    prefill_peers.Shape("64k whole prompt", [65536], [65536]),
    prefill_peers.Shape(f"{CHUNK // 1024}k chunk, ctx 32k", [CHUNK], [32768]),
    prefill_peers.Shape("4 x 4k whole prompts", [4096] * 4, [4096] * 4),
)


def candidates() -> list[dict[str, int]]:
    """Every config of the sweep; the built-in PAGED_TMA_CONFIG is among them."""
    return [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s, "paged_tma": True}
        for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4))
    ]


def check(config: dict[str, int], scale: float) -> str | None:
    """None if the kernel at `config` matches the reference on a small odd batch (decode rows,
    chunks starting inside a page, a band ending inside a tile); else why not."""
    try:
        err, _ = prefill_peers.error_of_ours(attention_inputs, scale, PAGE, config)
    except Exception as err:  # a config the compiler or the card rejects (shared memory, registers)
        return f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    return None if err <= prefill_peers.PEER_TOLERANCE else f"max|err| {err:.2e}"


def sweep(peak: float) -> list[dict]:
    """Each config's TFLOP/s per shape (None where it failed its check)."""
    scale = HEAD_DIM**-0.5
    inputs = [attention_inputs(s.q_lens, s.ctx_lens, block_size=PAGE) for s in SHAPES]
    flops = [prefill_peers.causal_flops(s.q_lens, s.ctx_lens, Q_HEADS, HEAD_DIM) for s in SHAPES]
    print(f"{'config':<22}" + "".join(f"{s.name:>24}" for s in SHAPES) + f"{'geomean':>10}")
    rows = []
    for config in candidates():
        failed = check(config, scale)
        if failed:
            print(f"{config_label(config):<22} skipped: {failed}")
            rows.append({"config": config, "tflops": None, "note": failed})
            continue
        tflops = []
        for args, f in zip(inputs, flops, strict=True):
            out = torch.empty_like(args[0])
            ms = prefill_peers.bench_ms(
                lambda args=args, out=out, config=config: tiled.prefill_attention(
                    *args, out, scale, None, config=config))
            tflops.append(f / ms / 1e9)
        mean = math.exp(sum(map(math.log, tflops)) / len(tflops))
        print(f"{config_label(config):<22}" + "".join(f"{t / peak:>24.1%}" for t in tflops) + f"{mean / peak:>10.1%}",
              flush=True)
        rows.append({"config": config, "tflops": tflops, "geomean_tflops": mean})
    return rows


def record(device: str, best: dict, default: dict, peak: float) -> None:
    """Merge this device's winner into the tuned-config file."""
    path = tiled.TUNED_CONFIGS
    table = json.loads(path.read_text()) if path.exists() else {}
    config = {k: v for k, v in best["config"].items() if k != "paged_tma"}
    table.setdefault(device, {})[tiled.tuned_key(DTYPE, HEAD_DIM)] = {
        "config": config,
        "shapes": [s.name for s in SHAPES],
        "pct_of_matmul_peak": [round(t / peak, 4) for t in best["tflops"]],
        "built_in_pct_of_matmul_peak": [round(t / peak, 4) for t in default["tflops"]],
        "triton": triton.__version__,
    }
    path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(f"recorded for {device!r} in {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the winner for this GPU kind")
    parser.add_argument("--json", type=Path, help="write every config's figures to this JSON file")
    opts = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("tune_prefill needs a CUDA device of compute capability 9+ (TMA); none found, nothing tuned.")
        return 1
    sys.stdout.reconfigure(line_buffering=True)
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    peak = matmul_peak_tflops()
    print(f"device {device}: bf16 matmul peak {peak:.1f} TFLOP/s; {PAGE}-token pages, % of that peak")
    rows = sweep(peak)
    timed = [r for r in rows if r["tflops"]]
    if not timed:
        print("no config passed its check: nothing recorded")
        return 1
    best = max(timed, key=lambda r: r["geomean_tflops"])
    default = next(r for r in rows if r["config"] == tiled.PAGED_TMA_CONFIG)
    print(f"best {config_label(best['config'])}: geomean {best['geomean_tflops'] / peak:.1%} of peak; built-in "
          f"{config_label(default['config'])}: {default['geomean_tflops'] / peak:.1%}" if default["tflops"] else
          f"best {config_label(best['config'])}; the built-in config failed its check")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"device": device, "peak_tflops": peak, "page": PAGE,
                                         "shapes": [s.name for s in SHAPES], "rows": rows}, indent=2))
    if opts.write and default["tflops"]:
        if best["geomean_tflops"] >= (1 + MIN_GAIN) * default["geomean_tflops"]:
            record(device, best, default, peak)
        else:
            print(f"the built-in config is within {MIN_GAIN:.0%} of the best: nothing recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
