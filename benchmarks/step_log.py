"""`tieredkv` with every engine step recorded: when it started, where its time went, and what it
ran. Written to a JSON object when the command ends.

    python benchmarks/step_log.py steps.json -- run configs/mooncake_synthetic_8b.yaml --sweep speed=8 \
        --variants gpu+cpu16 --no-progress

`steps.json` holds `fields` (the names below) and `steps`, one list of them a step that ran a
forward pass:
- `start_s`, `ms`: when the step began (the loop's clock) and how long it took;
- `schedule_ms`, `tiers_ms`: the engine loop's figures of the step (`LOOP_STATS`: the scheduler;
  the tiers' bookkeeping, this step's and, after the launch, the next one's);
- `host_ms`: from the step's beginning until its launch returned, and `launch_ms`, the part of it
  inside the launch (`LLMEngine._launch`), which waits for the GPU once the GPU's queue of
  kernels is full; the engine learns the rest as the loop's time (`LaunchedPrefill`);
- `sample_ms`: sampling, which waits for the GPU;
- `gpu_queue_tokens`: prefill tokens queued on the GPU and not finished when the step launched;
- `prefill_tokens`, `prefill_seqs`, `decode_seqs`: what it ran; `context_tokens`,
  `longest_context`: the tokens its prefill chunks attend to before themselves (summed, and the
  largest); `preempted`: sequences preempted to make room;
- `transfer_jobs`, `transfer_dmas`, `transfer_submit_ms`: the CPU tier's copies submitted in the
  step (`TransferEngine.submit`: demotions, promotions, swaps, landed loads), the DMAs they make
  (runs of neighbouring CPU blocks: the CUDA engine copies each run apart), and the host's time
  inside `submit` (on CUDA, queueing them: it waits only when a stream's queue is full; on the
  CPU, the copies themselves);
- `store_submit_ms`: the host's time handing reads and writes to the NVMe store.

It shows what a mean hides: which steps take long to launch and why, whether decodes ride in
steps with prefill chunks, and how long those steps take at each chunk size and depth
(BENCHMARKS.md, "One schedule for every variant").
"""

from __future__ import annotations

import atexit
import json
import sys
import time

import numpy as np

from tieredkv.cli import main
from tieredkv.engine import LLMEngine
from tieredkv.tiers.nvme.store import NVMeStore
from tieredkv.transfer.engine import TransferEngine

FIELDS = ("start_s", "ms", "schedule_ms", "tiers_ms", "host_ms", "launch_ms", "sample_ms", "gpu_queue_tokens",
          "prefill_tokens", "prefill_seqs", "decode_seqs", "context_tokens", "longest_context", "preempted",
          "transfer_jobs", "transfer_dmas", "transfer_submit_ms", "store_submit_ms")
IO_FIELDS = FIELDS[-4:]  # summed over the calls of a step
STEPS: list[list[float]] = []
_step, _launch, _sample = LLMEngine.step, LLMEngine._launch, LLMEngine._sample
_submit, _submit_reads, _submit_write = TransferEngine.submit, NVMeStore.submit_reads, NVMeStore.submit_write
_current: dict[str, float] = {}  # the step being recorded


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _logged_launch(self: LLMEngine, batch, tables, begun):
    prefill = seqs = decodes = context = longest = 0
    for item in batch.scheduled:
        seq = item.seq
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            decodes += 1
        else:
            prefill, seqs = prefill + item.num_new_tokens, seqs + 1
            context, longest = context + seq.num_computed_tokens, max(longest, seq.num_computed_tokens)
    queued = self.launched.tokens()
    start = time.perf_counter()
    result = _launch(self, batch, tables, begun)
    now = time.perf_counter()
    _current.update(host_ms=_ms(now - begun), launch_ms=_ms(now - start), gpu_queue_tokens=queued,
                    prefill_tokens=prefill, prefill_seqs=seqs, decode_seqs=decodes, context_tokens=context,
                    longest_context=longest, preempted=len(batch.preempted))
    return result


def _logged_sample(self: LLMEngine, batch, result):
    start = time.perf_counter()
    news = _sample(self, batch, result)
    _current["sample_ms"] = _ms(time.perf_counter() - start)
    return news


def _add(**amounts: float) -> None:
    for name, amount in amounts.items():
        _current[name] = _current.get(name, 0) + amount


def _logged_submit(self: TransferEngine, job):
    # the job's runs of neighbouring CPU blocks, as `transfer.engine.consecutive_runs` splits them
    # in CPU order, counted in numpy: this time falls inside the step it measures
    ids = np.sort(np.asarray(job.cpu_block_ids))
    dmas = int(np.count_nonzero(np.diff(ids) != 1)) + 1 if len(ids) else 0
    start = time.perf_counter()
    try:
        return _submit(self, job)
    finally:
        _add(transfer_jobs=1, transfer_dmas=dmas, transfer_submit_ms=(time.perf_counter() - start) * 1e3)


def _timed_store(submit):
    def logged(self: NVMeStore, *args):
        start = time.perf_counter()
        try:
            return submit(self, *args)
        finally:
            _add(store_submit_ms=(time.perf_counter() - start) * 1e3)
    return logged


def _logged_step(self: LLMEngine):
    _current.clear()
    _current.update(dict.fromkeys(IO_FIELDS, 0))
    loop_before = dict(self._loop_s)
    start = time.perf_counter()
    outputs = _step(self)
    if "host_ms" in _current:  # a forward pass ran
        _current.update(start_s=round(start, 4), ms=_ms(time.perf_counter() - start),
                        schedule_ms=_ms(self._loop_s["loop_schedule_s"] - loop_before["loop_schedule_s"]),
                        tiers_ms=_ms(self._loop_s["loop_tiers_s"] - loop_before["loop_tiers_s"]))
        _current.update((name, round(_current[name], 3)) for name in ("transfer_submit_ms", "store_submit_ms"))
        STEPS.append([_current[name] for name in FIELDS])
    return outputs


if __name__ == "__main__":
    if "--" not in sys.argv[2:]:
        raise SystemExit("usage: step_log.py OUT.json -- <tieredkv arguments>")
    out = sys.argv[1]
    LLMEngine.step, LLMEngine._launch, LLMEngine._sample = _logged_step, _logged_launch, _logged_sample
    TransferEngine.submit = _logged_submit
    NVMeStore.submit_reads, NVMeStore.submit_write = _timed_store(_submit_reads), _timed_store(_submit_write)
    atexit.register(lambda: json.dump({"fields": FIELDS, "steps": STEPS}, open(out, "w")))
    args = sys.argv[sys.argv.index("--") + 1:]
    if args[:1] == ["run"] and "--in-process" not in args:
        args.insert(1, "--in-process")  # the engine this process patched, not one in a process of its own
    sys.exit(main(args))
