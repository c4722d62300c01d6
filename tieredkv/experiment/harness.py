"""Run a YAML experiment: clients drive `AsyncLLM` as the workload says; record every request.

Operations:
- `run_experiment(path, out_dir, compare, sweep=...) -> Outcome`: one run, or one per variant
  (`--compare`) and load point (`--sweep rate=0.5,1,2`); writes under `out_dir/<name>/` (emptied
  first) each run's result.json and plots, `comparison.json` and overlaid plots for a compare,
  `sweep.json` (goodput per variant) and its plot for a sweep. Ctrl-C (or SIGTERM) stops the run
  in progress, writes what its clients saw so far (`"partial": true`) and skips the rest.

Folders: `<name>/[<variant>/][<key>=<value>/]result.json`. A variant is a partial config merged
over the base one, e.g.
    variants:
      - {name: recompute-only, cache: {cpu_cache_bytes: 0}, scheduler: {preemption: recompute}}
      - {name: gpu+cpu, cache: {nvme_path: null, nvme_bytes: 0}}
A run with `restart_after_s` closes its engine that far into the workload and opens a new one
on the same config while the clients go on (`restart.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from tieredkv.async_engine import AsyncLLM
from tieredkv.config import EngineConfig
from tieredkv.experiment.metrics import (
    RequestRecord,
    Summary,
    format_comparison,
    format_summary,
    summarize,
)
from tieredkv.experiment.plots import write_comparison_plots, write_plots, write_sweep_plot
from tieredkv.experiment.prometheus import PrometheusExporter
from tieredkv.experiment.restart import EngineSlot, restart_figures
from tieredkv.experiment.results import (
    comparison_document,
    describe_engine,
    result_document,
    write_json,
)
from tieredkv.experiment.spec import Experiment, Run, load_experiment, preflight
from tieredkv.experiment.sweep import format_sweep, sweep_document
from tieredkv.experiment.workloads import describe_workload
from tieredkv.sampling import SamplingParams

__all__ = ["Outcome", "format_comparison", "format_summary", "format_sweep", "run_experiment"]

logger = logging.getLogger(__name__)

TIMELINE_PERIOD_S = 0.05
PROGRESS_PERIOD_S = 0.5
TIMELINE_KEYS = ("gpu_blocks_used", "gpu_blocks_cached", "cpu_blocks_used", "cpu_blocks_cached", "nvme_slots_used",
                 "decode_tokens")


@dataclass
class Outcome:
    """What `run_experiment` did: each finished (or interrupted) run's summary, the
    comparison / sweep documents it wrote, and the runs that failed ("name: error")."""

    folder: str
    summaries: list[Summary]
    comparison: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    interrupted: bool = False
    failed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    """`engine_process`: each engine runs in a process of its own, as `tieredkv serve` runs it,
    so that the clients' event loop and the engine loop do not take turns on one GIL (False:
    in a thread of this process, where a wrapper of `LLMEngine` can see it)."""

    use_tqdm: bool = True
    on_summary: Callable[[Summary], None] | None = None
    exporter: PrometheusExporter | None = None
    keep_prompt_ids: bool = False
    engine_process: bool = True


class _Client:
    """Sends a workload's requests through AsyncLLM (the slot's engine, which a restart
    replaces) and records what it sees."""

    def __init__(self, slot: EngineSlot, bar: tqdm, name: str, options: Options) -> None:
        self.slot, self.bar, self.name, self.options = slot, bar, name, options
        self.records: list[RequestRecord] = []
        self.output_tokens = 0

    async def request(self, prompt: list[int] | str, max_tokens: int, tag: str, returning: bool = False) -> list[int]:
        record = RequestRecord(tag, time.monotonic(), returning)
        self.records.append(record)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        at_the_door = not self.slot.letting_in
        llm = await self.slot.acquire()
        if at_the_door:
            record.restart_wait = time.monotonic() - record.arrival
        try:
            async for out in llm.generate_stream(prompt, params):
                # an output read late holds the tokens of those it stands for: seen now, all of them
                new = len(out.token_ids) - len(record.output_token_ids)
                record.token_times.extend([time.monotonic()] * new)
                self.output_tokens += new
                record.output_token_ids = out.token_ids
                record.prompt_tokens = len(out.prompt_token_ids)
                record.cached_tokens = out.metrics.num_cached_tokens if out.metrics else 0
                if out.metrics is not None and out.metrics.ttft_split is not None:
                    record.ttft_split = out.metrics.ttft_split
                    record.engine_first_token = out.metrics.first_token_time
                if self.options.keep_prompt_ids and record.prompt_token_ids is None:
                    record.prompt_token_ids = list(out.prompt_token_ids)
            record.finished = True
        except ValueError as err:
            record.error, record.finished = str(err), True
        finally:
            self.slot.release()
        self.bar.update(1)
        exporter = self.options.exporter
        if exporter is not None:
            exporter.record(self.name, record.ttft, record.itls, len(record.token_times), record.error is not None)
        return list(record.output_token_ids)


class _Interrupt:
    """The first SIGINT / SIGTERM cancels the workload in progress (its partial results are
    written) and skips the runs left; the handlers then go, so a second signal stops at once."""

    def __init__(self) -> None:
        self.fired = False
        self.task: asyncio.Task | None = None
        self._signals: list[int] = []

    def __enter__(self) -> _Interrupt:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._fire)
                self._signals.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
                pass
        return self

    def _fire(self) -> None:
        logger.warning("interrupted: writing the partial results (interrupt again to stop at once)")
        self.fired = True
        self.__exit__()
        if self.task is not None:
            self.task.cancel()

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()


def run_experiment(
    path: str, out_dir: str = "results", compare: bool = False, use_tqdm: bool = True,
    on_summary: Callable[[Summary], None] | None = None, exporter: PrometheusExporter | None = None,
    sweep: str | None = None, keep_prompt_ids: bool = False, only: list[str] | None = None,
    engine_process: bool = True,
) -> Outcome:
    """Check the experiment and its results folder, then run it (module docstring). `sweep`:
    `KEY=V1,V2,...` over the file's `sweep:`; `only`: these variants, in this order;
    `on_summary` sees each run's summary as it ends; `exporter` publishes the engine's stats and
    the clients' latencies while it runs; `engine_process`: as `Options` says."""
    experiment = load_experiment(path, out_dir, compare, sweep, only=only)
    preflight(experiment)
    options = Options(use_tqdm, on_summary, exporter, keep_prompt_ids, engine_process)
    return asyncio.run(_run_all(experiment, options))


async def _run_all(experiment: Experiment, options: Options) -> Outcome:
    outcome = Outcome(experiment.folder, [])
    done: list[tuple[Run, Summary, dict[str, Any]]] = []
    failed: list[Run] = []
    with _Interrupt() as interrupt:
        for run in experiment.runs:
            if interrupt.fired:
                break
            ran = await _run_or_log(run, experiment, options, interrupt, outcome.failed)
            if ran is None:
                failed.append(run)
                # its engine's memory goes back before the next one is built (here, once the
                # exception and the frames it held are gone)
                gc.collect()
                continue
            summary, result = ran
            os.makedirs(run.folder, exist_ok=True)
            write_json(os.path.join(run.folder, "result.json"), result)
            write_plots(result, run.folder)
            done.append((run, summary, result))
            outcome.summaries.append(summary)
            if options.on_summary is not None:
                options.on_summary(summary)
    outcome.interrupted = interrupt.fired
    if experiment.sweep is not None and done:
        outcome.sweep = sweep_document(experiment, done, failed)
        write_json(os.path.join(experiment.folder, "sweep.json"), outcome.sweep)
        write_sweep_plot(outcome.sweep, experiment.folder)
    elif experiment.compare and done:
        outcome.comparison = comparison_document(experiment.name, outcome.summaries, [r.folder for r, _, _ in done],
                                                 outcome.failed)
        write_json(os.path.join(experiment.folder, "comparison.json"), outcome.comparison)
        write_comparison_plots([result for _, _, result in done], experiment.folder)
    return outcome


async def _run_or_log(run: Run, experiment: Experiment, options: Options, interrupt: _Interrupt,
                      failures: list[str]) -> tuple[Summary, dict[str, Any]] | None:
    """`_run`; or, when it fails and other runs follow, None, with the error logged and added
    to `failures`: one variant's failure (its engine, its workload) does not lose the others."""
    try:
        return await _run(run, experiment, options, interrupt)
    except Exception as exc:
        if len(experiment.runs) == 1:
            raise
        logger.error("%s failed; the other runs go on", run.name, exc_info=True)
        failures.append(f"{run.name}: {type(exc).__name__}: {exc}")
        return None


async def _run(run: Run, experiment: Experiment, options: Options,
               interrupt: _Interrupt) -> tuple[Summary, dict[str, Any]]:
    config = EngineConfig.from_dict(run.engine_doc)
    slot = EngineSlot(AsyncLLM(config=config, engine_process=options.engine_process))
    try:
        return await _serve(slot, config, run, experiment, options, interrupt)
    except BaseException:
        with contextlib.suppress(Exception):
            await slot.close()
        raise


async def _serve(slot: EngineSlot, config: EngineConfig, run: Run, experiment: Experiment, options: Options,
                 interrupt: _Interrupt) -> tuple[Summary, dict[str, Any]]:
    """Run the workload on the engine in `slot` and close it; the run's summary and result."""
    llm = slot.llm
    engine = describe_engine(llm.info)
    traced = await llm.trace_cpu_tier()  # the CPU tier's trace is replayed offline after the run
    logger.info("%s", startup_summary(run.name, engine))
    vocab = llm.info.limits.vocab_size
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    exporter = options.exporter
    publish = None if exporter is None else lambda stats: exporter.update(run.name, stats)
    with tqdm(total=run.workload.num_requests, desc=run.name, unit="req", disable=not options.use_tqdm) as bar:
        client = _Client(slot, bar, run.name, options)
        start = time.monotonic()
        sampler = asyncio.create_task(_timeline(slot, start, timeline, stop, publish, _progress(bar, client, start)))
        restart = None if run.restart is None else asyncio.create_task(slot.restart_at(run.restart, config, start))
        interrupt.task = asyncio.create_task(run.workload.run(client, vocab))
        if interrupt.fired:  # a signal came while the engine was being built
            interrupt.task.cancel()
        try:
            await interrupt.task
        except asyncio.CancelledError:
            if not interrupt.fired:
                raise
        finally:
            interrupt.task = None
            await _stop_restart(restart, slot)
        elapsed = time.monotonic() - start
        stop.set()
        await sampler
    stats = await asyncio.to_thread(slot.stats)
    if publish is not None:
        publish(stats)
    # the engine that started the run (a restart replaced it: its trace went with it)
    replayed = await llm.cpu_tier_replay() if traced and slot.llm is llm else None
    await slot.close()
    _remove_scratch_store(run)
    restart_doc = None if run.restart is None else restart_figures(run.restart, slot.record, client.records, start)
    if restart_doc is not None and not restart_doc["happened"]:
        logger.warning("%s: the workload ended before restart_after_s (%g s): no restart", run.name,
                       run.restart.after_s)
    summary = summarize(run.name, client.records, elapsed, stats, partial=interrupt.fired, restart=restart_doc)
    result = result_document(run.name, engine, describe_workload(run.workload), summary, client.records, start,
                             timeline, point=dict([run.point]) if run.point else None,
                             slo=experiment.slo.report(client.records, summary) if experiment.slo else None,
                             keep_prompt_ids=options.keep_prompt_ids)
    if replayed is not None:
        result["cpu_tier_replay"] = replayed
        logger.info("%s: CPU tier hit rate replayed on its block trace: %s", run.name, ", ".join(
            f"{policy} {rate:.1%}" for policy, rate in result["cpu_tier_replay"]["hit_rate"].items()))
    return summary, result


async def _stop_restart(restart: asyncio.Task | None, slot: EngineSlot) -> None:
    """Cancel a restart that has not begun; let one under way finish (it closes or opens an engine)."""
    if restart is None:
        return
    restart.cancel()
    await asyncio.gather(restart, return_exceptions=True)
    await slot.settle()


def startup_summary(name: str, engine: dict[str, Any]) -> str:
    """One line: tier sizes, I/O backend, preemption policy and cost model."""
    tiers = ", ".join(f"{tier.upper()} {t['blocks']} blocks ({t['tokens']} tokens, {t['bytes'] / 2**20:.1f} MiB)"
                      for tier, t in engine["tiers"].items())
    cost = engine["cost_model"]
    if cost is None:
        model = "none (not needed)"
    else:
        model = (f"{cost['source']}: D2H {cost['d2h_bytes_per_s'] / 1e9:.1f} GB/s, "
                 f"H2D {cost['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
                 f"prefill {cost['prefill_s_per_token'] * 1e6:.2f} us/token")
        if cost.get("disk_read_bytes_per_s"):
            model += f", disk {cost['disk_read_bytes_per_s'] / 1e9:.2f} GB/s"
    backend = f"; NVMe I/O: {engine['io_backend']}" if engine["io_backend"] else ""
    return (f"{name}: {engine['device']}; {tiers}{backend}; preemption {engine['preemption']}; "
            f"cost model {model}")


def _remove_scratch_store(run: Run) -> None:
    """A store inside the run's results folder (`${results}`) is scratch: remove it."""
    path = (run.engine_doc.get("cache") or {}).get("nvme_path")
    folder = os.path.abspath(run.folder)
    if path and os.path.abspath(path).startswith(folder + os.sep) and os.path.exists(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _progress(bar: tqdm, client: _Client, start: float) -> Callable[[dict[str, Any]], None]:
    """Shows output tokens/s and each tier's blocks (owned / all, and cached) on the progress
    bar, twice a second."""
    last = [0.0]

    def show(stats: dict[str, Any]) -> None:
        now = time.monotonic()
        if bar.disable or now - last[0] < PROGRESS_PERIOD_S:
            return
        last[0] = now
        parts = [f"{client.output_tokens / max(now - start, 1e-9):.0f} tok/s",
                 f"GPU {stats['gpu_blocks_used']}/{stats['gpu_blocks_total']} ({stats['gpu_blocks_cached']} cached)"]
        if "cpu_blocks_total" in stats:
            used, total, cached = stats["cpu_blocks_used"], stats["cpu_blocks_total"], stats["cpu_blocks_cached"]
            parts.append(f"CPU {used}/{total} ({cached} cached)")
        if "nvme_slots_total" in stats:
            parts.append(f"NVMe {stats['nvme_slots_used']}/{stats['nvme_slots_total']}")
        bar.set_postfix_str(", ".join(parts), refresh=False)
        bar.refresh()

    return show


async def _timeline(slot: EngineSlot, start: float, samples: list[dict[str, Any]], stop: asyncio.Event,
                    publish: Callable[[dict[str, Any]], None] | None,
                    progress: Callable[[dict[str, Any]], None]) -> None:
    while not stop.is_set():
        stats = await asyncio.to_thread(slot.stats)  # an engine process answers between two steps
        if publish is not None:
            publish(stats)
        progress(stats)
        if slot.serving:  # no samples while no engine is open (a restart): a gap in the plots
            samples.append({"t": time.monotonic() - start, **{k: stats.get(k, 0) for k in TIMELINE_KEYS}})
        try:
            await asyncio.wait_for(stop.wait(), TIMELINE_PERIOD_S)
        except TimeoutError:
            pass
