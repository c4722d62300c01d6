"""The engine loop and the public `LLM` API.

Operations:
- `LLMEngine.add_request(prompt, params)`: validate and queue a request (ValueError if it can
  never run).
- `LLMEngine.step()`: schedule, run one packed forward pass, sample, retire finished requests;
  `tend_tiers()`: with no request, let the tiers' I/O go on (how long to wait before the next call).
- `LLM.generate(prompts, params)`: run a batch to completion with a progress bar.
- `LLM.beam_search(prompts, params)`: beam search of each prompt, its candidates best first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import numbers
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from tieredkv.beam_search import BeamGroup, BeamSearchOutput, BeamSearchParams
from tieredkv.cache.hashing import model_fingerprint
from tieredkv.cache.manager import KVCacheManager
from tieredkv.cache.tier_chain import OneRankStores, build_tiers
from tieredkv.cache.trace import BlockTrace
from tieredkv.calibrate import DiskProbe, calibrate
from tieredkv.config import EngineConfig, api_config, read_engine_config
from tieredkv.decode import Decoder
from tieredkv.gc_pauses import GCPauses
from tieredkv.launched_prefill import LaunchedPrefill
from tieredkv.limits import RequestLimits
from tieredkv.model import locate
from tieredkv.model.runner import ModelRunner
from tieredkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tieredkv.parallel.plan import Drawn
from tieredkv.parallel.workers import Workers
from tieredkv.parallel_sampling import SampleGroup
from tieredkv.policy import CostModel, TierPolicy, needs_cost_model
from tieredkv.prompts import Prompt, prompt_list, token_ids
from tieredkv.sampling import SamplingParams
from tieredkv.scheduler import Scheduler, SchedulerOutput
from tieredkv.sequence import Sequence as Seq
from tieredkv.text import IncrementalDetokenizer, Message, chat_prompt
from tieredkv.tiers.nvme.store import DEFAULT_QUEUE_DEPTH
from tieredkv.tiers.remote import NVME_STORE_STATS
from tieredkv.values import check_request_id

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256
IO_WAIT_S = 0.0005  # a step with nothing to run sleeps this long (releases the GIL to the I/O threads)
# with no request, the engine loop tends the tiers this often while their I/O goes on; twice as
# long after each tend that found nothing finished (a disk that hangs), up to MAX_TEND_EVERY_S
TEND_EVERY_S = 0.005
MAX_TEND_EVERY_S = 0.5
# where the engine loop's time goes, cumulative seconds in stats(): scheduling; tier bookkeeping
# (retiring transfers, block tables, submitting demotions and spills); the model (block copies,
# forward pass, sampling); waiting with nothing to run (lower-tier reads in flight)
LOOP_STATS = ("loop_schedule_s", "loop_tiers_s", "loop_model_s", "loop_idle_s")


def _arrival(arrival_time: float | None) -> float:
    """A request's arrival on the `time.monotonic()` clock (None: now); ValueError for anything
    else, e.g. a wall-clock `time.time()`, which lies far in that clock's future."""
    now = time.monotonic()
    if arrival_time is None:
        return now
    if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real) \
            or not -math.inf < arrival_time <= now:
        raise ValueError(f"arrival_time: expected a time.monotonic() reading taken when the request arrived "
                         f"(now {now:.3f}), got {arrival_time!r}")
    return float(arrival_time)


class LLMEngine:
    """Scheduler + KV cache manager + model runner, stepped by the caller. With
    `tensor_parallel_size` > 1 the model runner is `Workers`: one process per rank, each holding
    its share of the model and of every KV tier; everything else stays here."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = dataclasses.replace(config, model=locate.resolve(config.model))  # no "auto" left
        parallel = config.parallel.tensor_parallel_size > 1
        self.runner: ModelRunner | Workers = Workers(config) if parallel else ModelRunner(config.model)
        block_size = config.cache.block_size
        num_blocks = self.runner.num_gpu_blocks(config.cache)
        self.runner.allocate_kv_cache(num_blocks, block_size)
        hf_config = self.runner.hf_config.to_dict()
        self.fingerprint = model_fingerprint(
            hf_config, self.runner.weights_id, config.model.dtype, block_size, self.runner.tp_layout
        )
        host = self.runner if isinstance(self.runner, Workers) else OneRankStores(self.runner.cpu_tier,
                                                                                  self.block_bytes)
        tiers = build_tiers(config.cache, self.block_bytes, self.fingerprint, host)
        self.remote = tiers.remote  # the remote tier's own store (its stats, bandwidth)
        self.kv = KVCacheManager(num_blocks, block_size, self.fingerprint, tiers.offload)
        policy = TierPolicy(config.scheduler.preemption, self.block_bytes, block_size, self._cost_model())
        # ranks in processes of their own answer each step: only a local GPU runs behind the loop
        self.launched = LaunchedPrefill(torch.device("cpu") if parallel else self.runner.device)
        self.scheduler = Scheduler(config.scheduler, self.kv, policy, self.launched)
        self.limits = RequestLimits(self.runner.hf_config.vocab_size, self.runner.max_model_len, num_blocks,
                                    block_size, config.scheduler.max_num_seqs)
        if self.runner.device.type == "cuda" and not config.model.enforce_eager:
            self.runner.capture_graphs(min(config.scheduler.max_num_seqs, MAX_GRAPH_BATCH))
        self.decoder = Decoder(self.scheduler, self._decode_token if self.tokenizer is not None else None)
        self.seqs: dict[str, Seq] = {}  # unfinished requests, by id: their first sequence
        self._ids = itertools.count()
        self._counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "requests_finished": 0}
        self._loop_s = dict.fromkeys(LOOP_STATS, 0.0)
        self._longest_step_s = 0.0  # one step's forward pass and sampling: a stall shows here
        # steps with no prefill token: how many, the loop's time before each launch, each whole step
        self._decode_steps = {"decode_steps": 0, "decode_step_host_s": 0.0, "decode_step_schedule_s": 0.0,
                              "decode_step_s": 0.0}
        self._tend_every_s = TEND_EVERY_S  # how long the idle loop waits between two tends
        self._retired = False  # the tiers' bookkeeping ran beside the last forward pass
        self._gc = GCPauses()  # the collector's pauses stop the loop too
        self._closed = False

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def block_bytes(self) -> int:
        return self.runner.kv_spec.block_bytes(self.config.cache.block_size)

    def _cost_model(self) -> CostModel | None:
        """Pinned in the config, else measured where one is needed (`needs_cost_model`)."""
        sched, cache = self.config.scheduler, self.config.cache
        slow_tier = cache.nvme_path is not None or cache.remote_url is not None
        needed = needs_cost_model(sched.scheduling_policy, sched.preemption, self.kv.offload is not None, slow_tier)
        if sched.cost_model is not None or not needed:
            return sched.cost_model
        longest = min(self.kv.num_blocks * self.kv.block_size, self.runner.max_model_len)  # tokens of one sequence
        max_tokens = min(longest, sched.max_num_batched_tokens)  # the largest prefill step it will run
        disk_dir = cache.nvme_path
        if disk_dir is not None and not os.path.isdir(disk_dir):  # the store's file itself
            disk_dir = os.path.dirname(os.path.abspath(disk_dir))
        backend = self.kv.stats().get("nvme_io_backend", cache.io_backend)  # the store's: `sync` where uring fell back
        probe = DiskProbe(disk_dir, self.block_bytes, DEFAULT_QUEUE_DEPTH, backend) if disk_dir else None
        if isinstance(self.runner, Workers):  # the ranks measure; each call returns once they are done
            return self._with_remote_reads(self.runner.calibrate(self.fingerprint, max_tokens, longest, probe))
        device = self.runner.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        key = f"{name}/{self.fingerprint:016x}"
        return self._with_remote_reads(calibrate(key, device, self.runner.prefill_probe, max_tokens, probe,
                                                 max_context_tokens=longest))

    def _with_remote_reads(self, cost: CostModel) -> CostModel:
        """With a remote tier, loads are planned against the slower of the disk and the server,
        whose read bandwidth is measured now (not cached: the server may be another next time)."""
        remote = self.remote.measure_read_bandwidth() if self.remote is not None else None
        if remote is None:
            return cost
        speeds = [s for s in (cost.disk_read_bytes_per_s, remote) if s is not None]
        logger.info("remote tier reads %.2f GB/s", remote / 1e9)
        return dataclasses.replace(cost, disk_read_bytes_per_s=min(speeds))

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; raise ValueError (saying what to change) if it can never run.
        `arrival_time` (`time.monotonic()`, default now): where its TTFT and its split start,
        e.g. when a front end took it, before it waited for the step in progress."""
        seq = self.make_sequence(prompt, params, request_id, arrival_time)
        self.enqueue(seq)
        return seq.request_id

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      arrival_time: float | None = None) -> Seq:
        """Validate a request (ValueError if it can never run) without queueing it. Reads no
        state that `step()` changes, so it may run beside a step. RuntimeError once closed."""
        params = self.limits.check_params(params)
        token_ids, request_id = self._new_request(prompt, request_id)
        self.limits.check_sampling(len(token_ids), params)
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params) if self.tokenizer else None
        generators = [self._generator(params, i) for i in range(params.num_samples)]
        seq = Seq(request_id, token_ids, params, self.runner.eos_token_ids, generators[0], detokenizer,
                  arrival_time=_arrival(arrival_time))
        if params.num_samples > 1:
            SampleGroup(seq, generators)
        return seq

    def make_beam_sequence(self, prompt: Prompt, params: BeamSearchParams, request_id: str | None = None) -> Seq:
        """Validate a beam-search request (ValueError if it can never run) without queueing it;
        its result is `seq.group.result(...)` once it has finished."""
        _check_beam_params(params)
        token_ids, request_id = self._new_request(prompt, request_id)
        self.limits.check_request(len(token_ids), params.max_tokens, "beam_width", params.beam_width)
        # beams never stop by themselves: the beam search ends them
        beam_params = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True)
        seq = Seq(request_id, token_ids, beam_params, self.runner.eos_token_ids)
        decode = self._decode_text if self.tokenizer is not None else None
        BeamGroup(seq, params, self.runner.eos_token_ids, decode)
        return seq

    def _new_request(self, prompt: Prompt, request_id: str | None) -> tuple[list[int], str]:
        """A request's token ids and id, checked: its id is free (the caller then checks it
        against `RequestLimits`)."""
        self._check_open()
        if request_id is not None:
            check_request_id(request_id)
        token_ids = self.tokenize(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        return token_ids, request_id

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _decode_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; create a new one to generate")

    def enqueue(self, seq: Seq) -> None:
        """Queue a sequence from `make_sequence`; ValueError if its id is already queued or running."""
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id: {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (a string needs a tokenizer; ids are checked against the vocabulary)."""
        return token_ids(prompt, self.tokenizer, self.runner.hf_config.vocab_size)

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) that can ever run: the model's length, and the
        whole GPU tier."""
        return self.limits.max_request_tokens

    def _generator(self, params: SamplingParams, sample: int = 0) -> torch.Generator | None:
        """The generator of a request's sample (seeded with `seed + sample`)."""
        if params.greedy:
            return None
        if params.seed is not None:
            seed = (params.seed + sample) % 2**64
        else:
            seed = (self.config.model.seed * 1_000_003 + next(self._ids)) % 2**64
        # with workers, rank 0 samples with a generator of its own seeded from this one
        device = "cpu" if isinstance(self.runner, Workers) else self.runner.device
        return torch.Generator(device=device).manual_seed(seed)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free everything it holds; its last output (`finish_reason` "abort"),
        or None if no such request is unfinished."""
        check_request_id(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is None or _finished(seq):
            return None
        for s in seq.group.seqs if seq.group is not None else [seq]:
            if not s.is_finished:
                self.scheduler.abort(s)
        return self._output(seq)

    def reset_prefix_cache(self) -> int:
        """Drop the GPU and CPU prefix caches (not the NVMe store); how many blocks were dropped."""
        return self.kv.reset_prefix_cache()

    def trace_cpu_tier(self) -> bool:
        """Record from now on what the CPU tier is offered and asked for (`cache/trace.py`), for
        `cpu_tier_replay`; False without a CPU tier."""
        offload = self.kv.offload
        if offload is None:
            return False
        offload.trace = BlockTrace()
        return True

    def cpu_tier_replay(self) -> dict[str, object] | None:
        """The CPU tier's trace since `trace_cpu_tier`, replayed at the tier's size under every
        replay policy (`cache.trace.replay_all`); None if nothing was traced."""
        return self.kv.offload.replay() if self.kv.offload is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def tend_tiers(self) -> float | None:
        """With no request to step: let the tiers' I/O go on (writes to disk waiting for a step
        would wait until the next request). None once it is done; else the seconds to wait
        before calling again: `TEND_EVERY_S` while I/O finishes, twice as long after each call
        that found none finished (up to `MAX_TEND_EVERY_S`)."""
        self._retired = False  # the next step books what finishes from here on first
        with self._timed("loop_tiers_s"):
            finished = self.kv.tend()
        if finished is None:
            self._tend_every_s = TEND_EVERY_S
            return None
        self._tend_every_s = TEND_EVERY_S if finished else min(2 * self._tend_every_s, MAX_TEND_EVERY_S)
        return self._tend_every_s

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One scheduler step and forward pass; outputs of the requests that got a token (a
        beam search: of those that ended)."""
        self._tend_every_s = TEND_EVERY_S
        begun = time.perf_counter()
        if not self._retired:  # no forward pass since the last step's schedule
            with self._timed("loop_tiers_s"):
                self.kv.retire()
        self._retired = False
        scheduling = time.perf_counter()
        with self._timed("loop_schedule_s"):
            batch = self.scheduler.schedule()
        scheduled = time.perf_counter()
        if not batch.scheduled:
            if self.has_unfinished():  # everything waits for NVMe reads: let their threads run
                with self._timed("loop_idle_s"):
                    time.sleep(IO_WAIT_S)
            return []
        with self._timed("loop_tiers_s"):
            tables = [self.kv.block_table(s.seq) for s in batch.scheduled]
            self.kv.before_forward()
        start = time.perf_counter()
        with self._timed("loop_model_s"):
            result, prefill = self._launch(batch, tables, begun)
        # the next step's tier bookkeeping, while the GPU runs this one (nothing between here and
        # the next schedule starts a transfer or a tier job)
        with self._timed("loop_tiers_s"):
            self.kv.retire()
        self._retired = True
        with self._timed("loop_model_s"):
            news = self._sample(batch, result)
        ended = time.perf_counter()
        self._longest_step_s = max(self._longest_step_s, ended - start)
        if not prefill:  # the gap between two tokens of a decoding request
            self._decode_steps["decode_steps"] += 1
            self._decode_steps["decode_step_host_s"] += start - begun
            self._decode_steps["decode_step_schedule_s"] += scheduled - scheduling
            self._decode_steps["decode_step_s"] += ended - begun
        outputs = [self._output(seq) for seq in news]
        for out in outputs:
            if out.finished and self.seqs.pop(out.request_id, None) is not None:
                self._counters["requests_finished"] += 1
        return outputs

    def _launch(self, batch: SchedulerOutput, tables: list[list[int]],
                begun: float) -> tuple[torch.Tensor | Drawn, int]:
        """Start the batch's forward pass (on one GPU its kernels are queued: the GPU is still
        running them on return; the step was `begun` then, on the loop's clock) and move the
        scheduled sequences on; the logits, or the tokens the tensor-parallel ranks drew, and
        the step's prefill tokens."""
        self.runner.copy_blocks(self.kv.take_block_copies())  # copy-on-write, before the writes
        # the loop's own time before the GPU is given the step: once the GPU's queue of kernels is
        # full, the launch below waits for the GPU, and that wait is the GPU's time, not the loop's
        host_s = time.perf_counter() - begun
        if isinstance(self.runner, Workers):  # rank 0 draws where the logits are, as the decoder would
            result = self.runner.execute(batch.scheduled, tables, batch.sampling, self.decoder.draws(batch.sampling))
        else:
            result = self.runner.execute(batch.scheduled, tables)
        prefill = self._count(batch)  # before `advance` moves the sequences on
        self.launched.launched(prefill, batch.num_tokens, host_s)
        self.scheduler.advance(batch)
        return result, prefill

    def _sample(self, batch: SchedulerOutput, result: torch.Tensor | Drawn) -> list[Seq]:
        """Sample from the launched step's logits (waiting for the GPU); the sequences that got news."""
        if isinstance(result, Drawn):
            return self.decoder.append(batch.sampling, result)
        return self.decoder.process(batch.sampling, result)

    @contextlib.contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        """Add the time the block takes to the engine-loop figure `key` (`LOOP_STATS`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._loop_s[key] += time.perf_counter() - start

    def _count(self, batch: SchedulerOutput) -> int:
        """Count the step's prefill and decode tokens; its prefill tokens."""
        prefill = 0
        for item in batch.scheduled:
            if item.seq.num_computed_tokens >= item.seq.num_prompt_tokens:
                self._counters["decode_tokens"] += item.num_new_tokens
            else:
                prefill += item.num_new_tokens
        self._counters["prefill_tokens"] += prefill
        self._counters["steps"] += 1
        return prefill

    def _output(self, seq: Seq) -> RequestOutput:
        """The output of the request `seq` started (its samples or beams: `outputs`)."""
        group = seq.group
        outputs = group.completions() if group is not None else [seq.completion()]
        first = outputs[0] if outputs else CompletionOutput(0, [], None, seq.finish_reason)
        samples = group.seqs if group is not None else [seq]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=first.token_ids,
            finished=_finished(seq),
            finish_reason=first.finish_reason,
            text=first.text,
            error=next((s.error for s in samples if s.error is not None), seq.error),
            text_delta=seq.text_delta if group is None else None,
            metrics=RequestMetrics(
                seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_prompt_tokens, seq.num_cached_tokens,
                dict(seq.ttft_split.seconds) if seq.ttft_split.closed else None,
            ),
            outputs=outputs,
        )

    def stats(self) -> dict[str, Any]:
        """Blocks per tier, prefix-cache hits, preemptions by kind, NVMe prefix blocks by the cost
        model's choice (load or compute), tokens computed, where the loop's time went
        (`LOOP_STATS`), the remote tier's counters."""
        launch_fixed_s, launch_per_token_s = self.launched.launch_time.fit()  # learned on a GPU (0 elsewhere)
        stats = {
            **self.kv.stats(),
            "preemptions": dict(self.scheduler.num_preemptions),
            "preempted_tokens": dict(self.scheduler.preempted_tokens),
            "recomputed_for_cpu_room": self.scheduler.recomputed_for_cpu_room,
            "held_back": dict(self.scheduler.held_back),
            "swap_fallbacks": self.scheduler.num_swap_fallbacks,
            **self.scheduler.loads.stats(),
            "nvme_skipped_tokens": self.scheduler.loaded_skipped_tokens,
            "nvme_load_waits": self.scheduler.load_waits,
            **self._counters,
            **self._loop_s,
            "longest_step_s": self._longest_step_s,
            **self._decode_steps,
            **self._gc.stats(),
            "launch_s_fixed": launch_fixed_s,  # the loop's launch time: every step's, and a token's
            "launch_s_per_token": launch_per_token_s,
            "requests_waiting": len(self.scheduler.waiting),
            "requests_running": len(self.scheduler.running),
            **(self.remote.stats() if self.remote is not None else {}),
        }
        if self.config.cache.nvme_path is None:  # the spill path served the remote tier alone
            for key in NVME_STORE_STATS:
                stats.pop(key, None)
        return stats


    def close(self) -> None:
        """Finish transfers and release the tiers; later requests raise RuntimeError. Closing
        twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self._gc.close()
        self.kv.close()
        self.runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_beam_params(params: object) -> None:
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params: expected a BeamSearchParams, got {type(params).__name__}")


def _finished(seq: Seq) -> bool:
    """Whether the request `seq` started has finished (all its samples, or its beam search)."""
    return seq.group.finished if seq.group is not None else seq.is_finished


class LLM(LLMEngine):
    """Synchronous batch API: `LLM(model=..., **keywords).generate(prompts, params)`.

    `generate` may be called from several threads: calls run one after another (a lock), each
    returning its own outputs. The step-level API it inherits (`add_request`, `step`, `abort`)
    is for one caller at a time, and is not mixed with `generate` (see there)."""

    def __init__(self, model: str = "tiny-llama", config: EngineConfig | None = None, **kwargs: Any) -> None:
        """`LLM(model=..., **keywords)`, or `LLM(config=EngineConfig(...))` (alone)."""
        super().__init__(api_config(model, config, kwargs))
        self._generate_lock = threading.Lock()
        self._scratch: weakref.finalize | None = None  # removes the folder `from_yaml` made for `${results}`

    @classmethod
    def from_yaml(cls, path: str) -> LLM:
        """An engine built from a YAML experiment file, or a config shipped with tieredkv
        (`demo`); its experiment sections are ignored and relative paths are taken from the
        file's folder. `${results}` (the run's results folder under `tieredkv run`) is a temporary
        folder of this engine's own, removed by `close()` (or when the engine is collected): a
        store there starts empty and leaves nothing behind."""
        config, scratch = read_engine_config(path)
        try:
            llm = cls(config=config)
        except BaseException:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        if scratch is not None:
            llm._scratch = weakref.finalize(llm, shutil.rmtree, scratch, ignore_errors=True)
        return llm

    def close(self) -> None:
        """As `LLMEngine.close`; then removes the folder `from_yaml` made for `${results}`."""
        super().close()
        if self._scratch is not None:
            self._scratch()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. A prompt is a
        string or token ids (a sequence of ints, or a 1-D numpy array / torch tensor; a 2-D one is a batch).
        A prompt that can never run, or fails while running, gets an output with `error` set;
        the others still complete.

        Raises RuntimeError if requests queued with `add_request()` are unfinished: `generate`
        steps the engine until its own prompts finish, so it would run theirs too and have
        nowhere to hand their outputs. Step them to completion (or `abort()` them) first."""
        prompts = prompt_list(prompts)
        return self._generate(len(prompts), lambda i: prompts[i], sampling_params, use_tqdm)

    def _generate(self, num_prompts: int, prompt: Callable[[int], Prompt],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        """`generate` of the prompts `prompt(i)`, each made when it is queued (a ValueError is
        that request's error)."""
        with self._generate_lock:
            self._check_idle("generate")
            if sampling_params is None or isinstance(sampling_params, SamplingParams):
                params = [sampling_params] * num_prompts
            elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
                params = list(sampling_params)
            else:
                params = [sampling_params]
            wrong = next((p for p in params if p is not None and not isinstance(p, SamplingParams)), None)
            if wrong is not None:
                raise ValueError("sampling_params: expected a SamplingParams or one per prompt, "
                                 f"got {type(wrong).__name__}")
            if len(params) != num_prompts:
                raise ValueError(
                    f"sampling_params: got {len(params)} for {num_prompts} prompts; give one or one per prompt"
                )
            return self._run_batch(num_prompts, lambda i: self.add_request(prompt(i), params[i]), use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam search of every prompt (its beams share their blocks, copied on write); for each
        prompt its finished candidates, best first. A prompt that can never run gets an output
        with `error` set and no candidates. Same calling rules as `generate`."""
        _check_beam_params(params)  # the call's fault, not any one prompt's
        prompts = prompt_list(prompts)
        groups: dict[str, BeamGroup] = {}

        def add(i: int) -> str:
            seq = self.make_beam_sequence(prompts[i], params)
            self.enqueue(seq)
            groups[seq.request_id] = seq.group
            return seq.request_id

        with self._generate_lock:
            self._check_idle("beam_search")
            outs = self._run_batch(len(prompts), add, use_tqdm)
        return [groups[o.request_id].result(o.prompt_token_ids, o.error) if o.request_id in groups
                else BeamSearchOutput(o.request_id, [], [], o.error) for o in outs]

    def _check_idle(self, name: str) -> None:
        self._check_open()
        if self.seqs:
            names = ", ".join(list(self.seqs)[:5])
            raise RuntimeError(
                f"{name}: {len(self.seqs)} request(s) queued with add_request() are unfinished ({names}); "
                f"step() them to completion or abort() them before calling {name}()"
            )

    def _run_batch(self, num_prompts: int, add: Callable[[int], str], use_tqdm: bool) -> list[RequestOutput]:
        """Queue prompt i with `add(i)` (its request id; ValueError: rejected) and run them all to
        completion; their finished outputs in order."""
        results: dict[str, RequestOutput] = {}
        order = []
        for i in range(num_prompts):
            try:
                order.append(add(i))
            except ValueError as err:
                logger.warning("request rejected: %s", err)
                order.append(rid := f"rejected-{next(self._ids)}")
                results[rid] = RequestOutput(rid, [], [], True, "error", error=str(err))
        try:
            self._run_to_completion(results, num_prompts, use_tqdm)
        except BaseException:  # a failed step (or Ctrl-C) must not leave this batch holding blocks
            for rid in order:
                self.abort(rid)
            raise
        return [results[rid] for rid in order]

    def _run_to_completion(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        with tqdm(total=total, desc="generate", disable=not use_tqdm) as bar:
            bar.update(len(results))
            while self.has_unfinished():
                for out in self.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Reply to a conversation (`[{"role": "user", "content": "..."}, ...]`), or to each of a
        list of them, through the tokenizer's chat template; outputs in order. A conversation the
        engine cannot take raises ValueError; in a list, it gets an output with `error` set
        (beginning `conversation <i>:`) and the others still complete."""
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages: expected a conversation ([{{'role': ..., 'content': ...}}, ...]) or a list "
                             f"of them, got {type(messages).__name__}")
        if messages and isinstance(messages[0], dict):
            return self.generate([chat_prompt(self.tokenizer, messages)], sampling_params, use_tqdm)
        conversations = list(messages)

        def prompt(i: int) -> list[int]:
            try:
                return chat_prompt(self.tokenizer, conversations[i])
            except ValueError as err:
                raise ValueError(f"conversation {i}: {err}") from None

        return self._generate(len(conversations), prompt, sampling_params, use_tqdm)
