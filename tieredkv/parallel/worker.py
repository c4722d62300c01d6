"""A rank's process: its share of the model, its KV heads of every GPU block, its slice of the
CPU tier (memory it shares with the driver, which does the NVMe I/O), its transfer engine;
rank 0 also draws each row's tokens, logprobs and beam candidates (as the one-rank decoder).

`worker_main` joins torch.distributed (NCCL on CUDA, gloo on the CPU), sets up how the ranks
sum their partial outputs (`make_all_reduce`: before any CUDA graph records one), loads the
shard, then runs the driver's calls (`Worker.<method>(*args)`, one reply each) until the driver
says stop or goes away. After an error it reports and exits: the driver stops the other ranks.
"""

from __future__ import annotations

import mmap
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing import connection, reduction
from typing import Any

import torch
import torch.distributed as dist

# the fork server imports these once, so that a rank's process starts with them loaded
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.mistral.modeling_mistral  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
import transformers.models.qwen3.modeling_qwen3  # noqa: F401

from tieredkv.calibrate import measure_bandwidth
from tieredkv.config import CacheConfig, EngineConfig
from tieredkv.logprobs import sampled_logprobs, top_logprobs
from tieredkv.model.all_reduce import make_all_reduce
from tieredkv.model.runner import ModelRunner, load_hf_config
from tieredkv.model.sharding import TPLayout
from tieredkv.parallel.plan import REPORTED_ERROR_EXIT, Drawn, StepPlan, StepReply
from tieredkv.sampling import Sampler, SamplingParams
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.engine import TransferEngine


def worker_main(
    config: EngineConfig, rank: int, world: int, store_port: int, conn: connection.Connection,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of rank `rank`'s process (`config` resolved by the driver; `env`: the
    driver's environment now, e.g. CUDA_VISIBLE_DEVICES, not the fork server's at its start)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    code = REPORTED_ERROR_EXIT
    try:
        worker = Worker(config, rank, world, store_port, conn)
        conn.send(("ok", worker.info()))
        code = _serve(worker, conn)
    except BaseException as err:  # reported to the driver, which stops every rank
        _report(conn, err)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # no teardown: a collective with a rank that died could hang it
        os._exit(code)


def _serve(worker: Worker, conn: connection.Connection) -> int:
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the driver went away
            return 0
        if method == "shutdown":
            return 0
        try:
            result = getattr(worker, method)(*args)
        except BaseException as err:
            _report(conn, err)
            return REPORTED_ERROR_EXIT
        conn.send(("ok", result))


def _largest_message(config: EngineConfig) -> int:
    """Elements of the largest all-reduce a forward pass makes: hidden states of the most
    tokens a step carries (or of a graphed decode batch, padded to `max_num_seqs`)."""
    tokens = max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    return tokens * load_hf_config(config.model.model).hidden_size


def _report(conn: connection.Connection, err: BaseException) -> None:
    try:
        conn.send(("error", (type(err).__name__, str(err), traceback.format_exc())))
    except OSError:
        pass


class Worker:
    """The calls the driver makes on every rank."""

    def __init__(self, config: EngineConfig, rank: int, world: int, store_port: int,
                 conn: connection.Connection) -> None:
        self.rank = rank
        self.conn = conn
        device = torch.device(config.model.device)
        if device.type == "cuda":
            torch.cuda.set_device(rank)  # "cuda" means this rank's GPU from here on
        else:  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world)
        self._warm_up(device)
        dtype = getattr(torch, config.model.dtype)
        self.all_reduce = make_all_reduce(config.parallel.all_reduce, device, dtype, _largest_message(config))
        self.runner = ModelRunner(config.model, TPLayout(rank, world), self.all_reduce)
        self.transfers: TransferEngine | None = None
        self._cpu_memory: mmap.mmap | None = None
        self._cpu_tier: CPUTier | None = None  # held while the rank lives: a dropped tier unpins its memory
        self._job_ids: dict[int, int] = {}  # this rank's transfer job id -> the driver's
        self.sampler = Sampler()
        # rank 0 samples them: their parameters, each sample's generator
        self.requests: dict[str, tuple[SamplingParams, list[torch.Generator | None]]] = {}

    @staticmethod
    def _warm_up(device: torch.device) -> None:
        """One collective: the communicators exist before anything (a CUDA graph) records one."""
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
        assert int(probe.item()) == dist.get_world_size(), "all-reduce of ones counts the ranks"

    def info(self) -> dict[str, Any]:
        name = torch.cuda.get_device_name() if self.runner.device.type == "cuda" else "cpu"
        return {"pid": os.getpid(), "device_name": name, "kv_spec": self.runner.kv_spec}

    def num_gpu_blocks(self, cache: CacheConfig) -> int:
        return self.runner.num_gpu_blocks(cache)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, block_size)

    def attach_cpu_tier(self, num_blocks: int, nbytes: int) -> None:
        """Map this rank's CPU tier slice, whose file descriptor the driver sends next."""
        fd = reduction.recv_handle(self.conn)
        try:
            self._cpu_memory = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        memory = torch.frombuffer(self._cpu_memory, dtype=torch.uint8)
        self._cpu_tier, self.transfers = self.runner.cpu_tier(num_blocks, memory)

    def capture_graphs(self, max_batch: int) -> None:
        self.runner.capture_graphs(max_batch)

    def prefill_probe(self, num_tokens: int, context_tokens: int = 0) -> None:
        self.runner.prefill_probe(num_tokens, context_tokens)
        self._synchronize()

    def measure_bandwidth(self) -> tuple[float, float]:
        return measure_bandwidth(self.runner.device)

    def apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(worker, *args)` on this rank: measurements that must run beside the shard
        (benchmarks pass functions of their own; `fn` travels by name, as pickle sends it)."""
        return fn(self, *args)

    def step(self, plan: StepPlan) -> StepReply:
        for i, job in enumerate(plan.jobs):
            self._job_ids[self.transfers.submit(job)] = plan.first_job + i
        if plan.later is not None:
            local = {driver: mine for mine, driver in self._job_ids.items()}
            self.transfers.order_compute([local[j] for j in plan.later if j in local])
        if plan.copies:  # copy-on-write, on the compute stream: after the ordering, before the writes
            self.runner.copy_blocks(plan.copies)
        drawn = None
        if plan.inputs is not None:
            logits = self.runner.run(plan.inputs)
            if self.rank == 0:
                self._learn(plan)
                drawn = self._draw(logits, plan)
        return self._reply(drawn)

    def wait(self, job_ids: list[int] | None) -> StepReply:
        """Wait for the driver's jobs `job_ids` (None: all) on this rank."""
        if self.transfers is not None:
            if job_ids is None:
                self.transfers.wait_all()
            else:
                wanted = set(job_ids)
                self.transfers.wait([mine for mine, driver in self._job_ids.items() if driver in wanted])
        return self._reply(None)

    def _reply(self, drawn: Drawn | None) -> StepReply:
        if self.transfers is None:
            return StepReply(drawn, [], 0.0)
        finished = [self._job_ids.pop(mine) for mine in self.transfers.poll()]
        return StepReply(drawn, finished, self.transfers.compute_wait_s)

    def _learn(self, plan: StepPlan) -> None:
        for request_id in plan.forget:
            self.requests.pop(request_id, None)
        device = self.runner.device
        for new in plan.new_requests:
            generators = [None if seed is None else torch.Generator(device=device).manual_seed(seed)
                          for seed in new.seeds]
            self.requests[new.request_id] = (new.params, generators)

    def _draw(self, logits: torch.Tensor, plan: StepPlan) -> Drawn:
        """Each sampling row's tokens (and logprobs), each beam row's best log-probs, as the
        one-rank decoder takes them (`Decoder.process`)."""
        samples = [(row, d, i) for row, d in enumerate(plan.draws) for i in d.samples]
        drawn = Drawn([])
        if samples:
            rows = [row for row, _, _ in samples]
            chosen = logits if rows == list(range(logits.shape[0])) else logits[rows]
            params = [self.requests[d.request_id][0] for _, d, _ in samples]
            generators = [self.requests[d.request_id][1][i] for _, d, i in samples]
            tokens = self.sampler.sample(chosen, params, generators, [d.banned for _, d, _ in samples])
            drawn = Drawn(tokens, sampled_logprobs(chosen, tokens, [d.num_top for _, d, _ in samples]))
        beams = [row for row, d in enumerate(plan.draws) if d.beam_top]
        if beams:
            values, ids = top_logprobs(logits[beams], plan.draws[beams[0]].beam_top)
            drawn = Drawn(drawn.tokens, drawn.logprobs, (values.numpy(), ids.numpy()))
        return drawn

    def _synchronize(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
