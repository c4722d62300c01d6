"""Where a serving run's time goes on the GPU: runs variants of an experiment file one after
another and records, for a window of each run, what the GPU did (torch profiler, CUDA activity)
and what the engine thread did (py-spy, if installed).

    python benchmarks/profile_run.py configs/mooncake_8b.yaml --variants gpu+cpu,gpu+cpu+nvme \
        --start 20 --window 10 --out /tmp/profile

For each variant it prints, over the window: kernel time as a share of the window (the GPU's
busy share), D2H and H2D copy time and how much of it ran beside kernels, idle gaps between
kernels (count, total, longest: the bubbles between steps), and the engine loop's split from
`stats()` (`loop_*_s`, where the engine reports it). A copy that runs beside kernels costs the
step little; one that the step waits for shows up as a gap.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_activity import Op, busy_s, op_kind, overlap_s  # noqa: E402

GAP_S = 1e-3  # an idle stretch of the GPU at least this long counts as a bubble


def gaps(kernels: list[Op], start_s: float, end_s: float) -> list[float]:
    """Idle stretches (seconds, at least GAP_S) between kernels inside [start_s, end_s]."""
    out, last = [], start_s
    for op in sorted(kernels, key=lambda o: o.start_s):
        if op.start_s - last >= GAP_S:
            out.append(op.start_s - last)
        last = max(last, op.end_s)
    if end_s - last >= GAP_S:
        out.append(end_s - last)
    return out


def figures(ops: list[Op]) -> dict[str, Any]:
    """The window's GPU figures (module docstring)."""
    if not ops:
        return {"ops": 0}
    start, end = min(o.start_s for o in ops), max(o.end_s for o in ops)
    kernels = [o for o in ops if o.kind == "kernel"]
    d2h = [o for o in ops if o.kind == "d2h"]
    h2d = [o for o in ops if o.kind == "h2d"]
    idle = gaps(kernels, start, end)
    window = end - start
    return {
        "window_s": window,
        "kernel_busy_share": busy_s(kernels) / window,
        "d2h_s": busy_s(d2h), "d2h_beside_kernels_s": overlap_s(d2h, kernels),
        "h2d_s": busy_s(h2d), "h2d_beside_kernels_s": overlap_s(h2d, kernels),
        "gaps": len(idle), "gaps_s": sum(idle), "longest_gap_ms": 1e3 * max(idle, default=0.0),
        "ops": len(ops),
    }


class Window:
    """The profiler (and py-spy) over [start_s, start_s + window_s) from `begin()`, on one thread
    (the profiler is stopped on the thread that started it); `end()` closes it early if the run
    ends first."""

    def __init__(self, start_s: float, window_s: float, spy_path: str | None) -> None:
        self.start_s, self.window_s, self.spy_path = start_s, window_s, spy_path
        self.ops: list[Op] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._record, daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def end(self) -> None:
        self._done.set()
        self._thread.join()

    def _record(self) -> None:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if self._done.wait(self.start_s):
            return
        if self.spy_path and shutil.which("py-spy"):
            subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--duration", str(int(self.window_s)),
                              "--format", "raw", "--output", self.spy_path, "--nonblocking"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cuda = torch.cuda.is_available()  # without one, the CPU ops stand in (a smoke test of the script)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            self._done.wait(self.window_s)
            if cuda:
                torch.cuda.synchronize()
        self.ops = [Op(op_kind(e.name), e.name, e.time_range.start / 1e6, e.time_range.end / 1e6)
                    for e in prof.events() if e.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU)]


def profile_variant(experiment, run, window: Window) -> dict[str, Any]:
    from tieredkv.experiment import harness

    one = dataclasses.replace(experiment, runs=[run], compare=False, sweep=None)
    window.begin()
    started = time.monotonic()
    options = harness.Options(False, None, None, False, engine_process=False)  # the profiler sees this process
    outcome = asyncio.run(harness._run_all(one, options))
    window.end()
    summary = outcome.summaries[0]
    return {
        "variant": run.variant, "run_s": time.monotonic() - started,
        "gpu": figures(window.ops),
        "loop": {k: v for k, v in summary.stats.items() if k.startswith("loop_")},
        "ttft_ms": {p: None if v is None else 1e3 * v for p, v in summary.ttft_s.items()},
        "itl_ms": {p: None if v is None else 1e3 * v for p, v in summary.itl_s.items()},
        "output_tokens_per_s": summary.output_tokens_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--variants", required=True, help="comma-separated variant names, run in this order")
    parser.add_argument("--start", type=float, default=20.0, help="seconds into each run the window opens")
    parser.add_argument("--window", type=float, default=10.0, help="seconds the window lasts")
    parser.add_argument("--out", default="results/profile")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    from tieredkv.experiment.spec import load_experiment, prepare_results

    experiment = load_experiment(args.config, args.out, compare=True)
    by_name = {run.variant: run for run in experiment.runs}
    wanted = args.variants.split(",")
    if unknown := [v for v in wanted if v not in by_name]:
        raise SystemExit(f"--variants: {unknown} not in {args.config}; it has {sorted(by_name)}")
    prepare_results(experiment.folder)
    records = []
    for name in wanted:
        spy = os.path.join(args.out, "pyspy-" + name.replace("+", "_") + ".txt")
        record = profile_variant(experiment, by_name[name], Window(args.start, args.window, spy))
        records.append(record)
        print(json.dumps(record, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
