"""PNG plots of an experiment's `result.json`: TTFT CDF, throughput over time, blocks per tier
over time. Needs matplotlib (the `plot` extra); without it the plots are skipped with a note."""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def write_plots(result: dict[str, Any], folder: str) -> list[str]:
    """Write the plots next to result.json; the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install tieredkv[plot]): no plots in %s", folder)
        return []
    paths = []
    for name, draw in (("ttft_cdf.png", _ttft_cdf), ("throughput.png", _throughput), ("blocks.png", _blocks)):
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, result)
        ax.set_title(f"{result['name']}: {ax.get_title()}")
        fig.tight_layout()
        path = os.path.join(folder, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _ttft_cdf(ax, result: dict[str, Any]) -> None:
    ttfts = sorted(r["ttft"] * 1e3 for r in result["requests"] if r["ttft"] is not None)
    ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], drawstyle="steps-post")
    ax.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax.grid(alpha=0.3)


def _throughput(ax, result: dict[str, Any]) -> None:
    times = sorted(t for r in result["requests"] for t in r["token_times"])
    if times:
        width = max(times[-1] / 50, 1e-3)
        bins = [0] * (int(times[-1] / width) + 1)
        for t in times:
            bins[int(t / width)] += 1
        ax.plot([i * width for i in range(len(bins))], [b / width for b in bins])
    ax.set(xlabel="time (s)", ylabel="output tokens/s", title="throughput over time")
    ax.grid(alpha=0.3)


def _blocks(ax, result: dict[str, Any]) -> None:
    timeline = result["timeline"]
    t = [s["t"] for s in timeline]
    for key, label in (("gpu_blocks_used", "GPU (owned)"), ("cpu_blocks_used", "CPU (owned)"),
                       ("cpu_blocks_cached", "CPU (cached prefixes)"), ("nvme_slots_used", "NVMe slots")):
        ax.plot(t, [s[key] for s in timeline], label=label)
    ax.set(xlabel="time (s)", ylabel="blocks", title="blocks per tier")
    ax.legend()
    ax.grid(alpha=0.3)
