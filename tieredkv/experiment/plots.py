"""PNG plots of experiment results.

- `write_plots(result, folder)`: one run: TTFT CDF (first and returning requests apart),
  throughput over time, blocks per tier over time with each tier's capacity.
- `write_comparison_plots(results, folder)`: the variants of a `--compare` overlaid, one colour
  each: `compare_ttft_cdf.png`, `compare_throughput.png`, `compare_blocks.png`.
- `write_sweep_plot(sweep, folder)`: `sweep.png`, TTFT p90 and throughput against the offered
  load, one line per variant (the TTFT target dashed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

TIERS = (("GPU", "gpu_blocks_used", "gpu"), ("CPU", "cpu_blocks_used", "cpu"), ("NVMe", "nvme_slots_used", "nvme"))


def _pyplot() -> Any:
    # matplotlib logs at INFO when it builds its font cache (a first run): the user's logging
    # level is for tieredkv, so matplotlib says only warnings
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, folder: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(folder, name)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def write_plots(result: dict[str, Any], folder: str) -> list[str]:
    """Write one run's plots next to its result.json; the paths written."""
    plt = _pyplot()
    paths = []
    draws: tuple[tuple[str, Callable[[Any, list[dict[str, Any]]], None]], ...] = (
        ("ttft_cdf.png", _ttft_cdf), ("throughput.png", _throughput))
    for name, draw in draws:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, [result])
        ax.set_title(f"{result['name']}: {ax.get_title()}")
        paths.append(_save(fig, folder, name))
    if result["engine"]["tiers"]:  # none known of a server measured from outside (tieredkv bench)
        paths.append(_blocks([result], folder, "blocks.png"))
    return paths


def write_comparison_plots(results: list[dict[str, Any]], folder: str) -> list[str]:
    """Overlay the variants of a compare; the paths written."""
    plt = _pyplot()
    paths = []
    for name, draw in (("compare_ttft_cdf.png", _ttft_cdf), ("compare_throughput.png", _throughput)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax, results)
        paths.append(_save(fig, folder, name))
    paths.append(_blocks(results, folder, "compare_blocks.png"))
    return paths


def _colour(i: int) -> str:
    return f"C{i % 10}"


def _ttft_cdf(ax: Any, results: list[dict[str, Any]]) -> None:
    """Solid: first requests (first turns, first questions); dashed: returning ones."""
    for i, result in enumerate(results):
        for returning, style in ((False, "-"), (True, "--")):
            ttfts = sorted(r["ttft"] * 1e3 for r in result["requests"]
                           if r["ttft"] is not None and r["returning"] == returning)
            if ttfts:
                label = f"{result['name']} ({'returning' if returning else 'first'}, n={len(ttfts)})"
                ax.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], style, color=_colour(i),
                        drawstyle="steps-post", label=label)
    ax.set(xlabel="time to first token (ms)", ylabel="fraction of requests",
           title="TTFT CDF (solid: first requests, dashed: returning)")
    if ax.lines:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _throughput(ax: Any, results: list[dict[str, Any]]) -> None:
    for i, result in enumerate(results):
        times = sorted(t for r in result["requests"] for t in r["token_times"])
        if times:
            width = max(times[-1] / 50, 1e-3)
            bins = [0] * (int(times[-1] / width) + 1)
            for t in times:
                bins[int(t / width)] += 1
            ax.plot([k * width for k in range(len(bins))], [b / width for b in bins], color=_colour(i),
                    label=result["name"])
    ax.set(xlabel="time (s)", ylabel="output tokens/s", title="throughput over time")
    if len(results) > 1 and ax.lines:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _blocks(results: list[dict[str, Any]], folder: str, name: str) -> str:
    """One panel per tier: blocks owned by requests (solid) and cached (dotted) over time, and
    the tier's capacity (dashed)."""
    plt = _pyplot()
    tiers = [t for t in TIERS if any(t[2] in r["engine"]["tiers"] for r in results)]
    fig, axes = plt.subplots(1, len(tiers), figsize=(4.5 * len(tiers), 4), squeeze=False)
    for ax, (label, key, tier) in zip(axes[0], tiers, strict=True):
        for i, result in enumerate(results):
            if tier not in result["engine"]["tiers"]:
                continue
            timeline = result["timeline"]
            t = [s["t"] for s in timeline]
            ax.plot(t, [s.get(key, 0) for s in timeline], color=_colour(i), label=result["name"])
            cached = key.replace("_used", "_cached")
            if tier != "nvme" and timeline and cached in timeline[0]:
                ax.plot(t, [s[cached] for s in timeline], ":", color=_colour(i))
            ax.axhline(result["engine"]["tiers"][tier]["blocks"], ls="--", color=_colour(i), lw=1)
        ax.set(xlabel="time (s)", ylabel="blocks", title=f"{label} (dashed: capacity, dotted: cached)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if len(results) == 1:
        fig.suptitle(f"{results[0]['name']}: blocks per tier")
    return _save(fig, folder, name)


def write_sweep_plot(sweep: dict[str, Any], folder: str) -> str:
    """TTFT p90 and throughput against the offered load, one line per variant."""
    plt = _pyplot()
    fig, (ttft, tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, variant in enumerate(sweep["variants"]):
        points = sorted((p for p in variant["points"] if not p["failed"]), key=lambda p: p["value"])
        x = [p["value"] for p in points]
        label = variant["name"] + ("" if variant["goodput"] is None else f" (goodput {variant['goodput']:g})")
        ttft.plot(x, [p["p90_ttft_ms"] for p in points], "o-", color=_colour(i), label=label)
        tput.plot(x, [p["output_throughput"] for p in points], "o-", color=_colour(i), label=variant["name"])
    target = (sweep["slo"] or {}).get("ttft_p90_ms")
    if target is not None:
        ttft.axhline(target, ls="--", color="grey", label=f"SLO ttft_p90_ms {target:g}")
    ttft.set(xlabel=f"offered load ({sweep['key']})", ylabel="TTFT p90 (ms)", title=f"{sweep['name']}: TTFT p90")
    tput.set(xlabel=f"offered load ({sweep['key']})", ylabel="output tokens/s", title="throughput")
    for ax in (ttft, tput):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, folder, "sweep.png")
