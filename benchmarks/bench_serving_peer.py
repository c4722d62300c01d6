"""The experiment of `tieredkv run CONFIG.yaml`, served by transformers' own continuous batching.

The peer is `model.init_continuous_batching(...)` of transformers (5.17 and 5.23 checked): its paged
KV cache gets our GPU budget (`num_blocks` blocks of `block_size` tokens, the same page size as ours,
so prefix sharing matches the same whole blocks), `max_batch_tokens` and `max_requests_per_batch`
from the scheduler section, and its pinned CPU swap pool (`cpu_offload_space`, GiB) the size of
`cache.cpu_cache_bytes` (CUDA only: pinned memory needs an accelerator). It has no NVMe tier. The
model is the same (a preset is built with the same seed, so the same weights), and so is the
workload: the YAML file's seeded clients call `request()`, which submits to the manager
(`add_request(..., streaming=True)`) and awaits the streamed outputs delivered on the event loop
(`register_result_handler`), so a multi-turn user sees each turn's output before its next turn.
Greedy decoding with EOS ignored (`eos_token_id=-1`): every request yields max_tokens tokens.

TTFT and inter-token latency are measured as `tieredkv run` measures ours: on the client, from the
call of `request()` to the moment the client coroutine receives each streamed token.

Writes result.json in the format of `tieredkv run` (no timeline) and prints the same summary. The
manager reports no counters, so `stats` come from wrapping three methods of its cache and offloading
manager: prefix-hit tokens, preemptions (`swap`: to the CPU pool, `recompute`: soft reset) and bytes
moved (KV length at offload, rounded up to whole blocks).

    python benchmarks/bench_serving_peer.py configs/multi_turn_8b.yaml \\
        [--out results/multi_turn_8b/transformers/result.json] [--max-requests N] [--attn sdpa]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from tieredkv.config import EngineConfig, ModelConfig, find_config
from tieredkv.engine_core.info import device_name
from tieredkv.experiment.metrics import RequestRecord, Summary, format_summary, summarize
from tieredkv.experiment.replay import ReplayWorkload
from tieredkv.experiment.results import result_document
from tieredkv.experiment.spec import load_experiment
from tieredkv.experiment.workloads import (
    LongDocQAWorkload,
    MultiTurnWorkload,
    PreemptionStormWorkload,
    Workload,
    describe_workload,
)
from tieredkv.model import locate
from tieredkv.model.presets import PRESETS, build_preset
from tieredkv.model.runner import KVSpec

WATCHDOG_S = 5.0  # how often a waiting request checks that the generation thread is still alive
TTFT_METHOD = "client side: from request() to the first streamed token reaching the client coroutine"


def _require(obj: object, names: tuple[str, ...], what: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise RuntimeError(
            f"transformers {transformers.__version__}: {what} lacks {', '.join(missing)}; this benchmark needs the "
            "continuous batching manager of transformers 5.17 or later (pip install 'transformers>=5.17')"
        )


def _cb_config_class() -> type:
    cls = getattr(transformers, "ContinuousBatchingConfig", None)
    if cls is None:
        raise RuntimeError(f"transformers {transformers.__version__} has no ContinuousBatchingConfig; "
                           "this benchmark needs transformers 5.17 or later")
    return cls


def longest_request(workload: Workload) -> tuple[int, int]:
    """(longest prompt, most new tokens) the workload sends: hints for sizing the peer's block tables."""
    if isinstance(workload, MultiTurnWorkload):
        first = workload.message_tokens if workload.first_message_tokens is None else workload.first_message_tokens
        prompt = workload.system_prompt_tokens + first + (workload.turns - 1) * workload.message_tokens
        return prompt + (workload.turns - 1) * workload.max_tokens, workload.max_tokens
    if isinstance(workload, LongDocQAWorkload):
        return workload.document_tokens + workload.question_tokens, workload.max_tokens
    if isinstance(workload, PreemptionStormWorkload):
        return workload.prompt_tokens, workload.max_tokens
    assert isinstance(workload, ReplayWorkload), f"unknown workload {type(workload).__name__}"
    requests = workload.requests
    return (max(r.line.num_prompt_tokens or 0 for r in requests),
            max(workload.output_tokens(r) for r in requests))


def peer_settings(config: EngineConfig, cb_fields: set[str]) -> dict[str, Any]:
    """Keywords of transformers' ContinuousBatchingConfig that match our cache and scheduler sections.
    `cb_fields` are its field names: the block size is `block_size` in 5.17, `page_size` in later versions."""
    cache, sched = config.cache, config.scheduler
    if cache.block_size < 4:
        raise ValueError(
            f"cache.block_size: transformers' paged cache needs blocks of >= 4 tokens, got {cache.block_size}")
    settings: dict[str, Any] = {
        "page_size" if "page_size" in cb_fields else "block_size": cache.block_size,
        "max_batch_tokens": sched.max_num_batched_tokens,
        "max_requests_per_batch": sched.max_num_seqs,
        "allow_block_sharing": True,  # prefix caching, as ours
        # pinned host memory needs an accelerator: no swap pool on a CPU-only run
        "cpu_offload_space": cache.cpu_cache_bytes / 2**30 if config.model.device == "cuda" else 0.0,
    }
    if cache.num_gpu_blocks is not None:
        settings["num_blocks"] = cache.num_gpu_blocks
    elif config.model.device == "cpu":
        settings["num_blocks"] = 256  # what our engine takes on a CPU
    else:
        settings["max_memory_percent"] = cache.gpu_memory_utilization
    return settings


def load_peer_model(config: ModelConfig, attn: str) -> PreTrainedModel:
    """The model our engine would run (a preset from its seed, or a local directory), with `attn`."""
    dtype = getattr(torch, config.dtype)
    if config.model in PRESETS:
        model = build_preset(config.model, config.seed, dtype, config.device, attn)
    elif os.path.isdir(config.model):
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, attn_implementation=attn)
    else:
        raise ValueError(f"model: {config.model!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory")
    _require(model, ("init_continuous_batching",), "the model")
    return model.to(config.device).eval()


class PeerCounters:
    """Figures the manager does not report, counted by wrapping methods of its batch processor's cache
    (`search_prefix_match`) and offloading manager (`_offload_to_cpu`, `restore_scheduled_requests`),
    which have the same signatures in 5.17 and 5.23. They run on the generation thread."""

    def __init__(self, block_size: int, block_bytes: int) -> None:
        self.block_size, self.block_bytes = block_size, block_bytes
        self.hits: dict[str, int] = {}  # request id -> prompt tokens found cached at its first scheduling
        self.swapped_bytes: dict[str, int] = {}  # request id -> bytes now in the CPU swap pool
        self.stats: dict[str, Any] = {"prefix_hit_tokens": 0, "preemptions": {"recompute": 0, "swap": 0},
                                      "bytes_d2h": 0, "bytes_h2d": 0}

    def install(self, processor: Any) -> None:
        _require(processor, ("cache", "offloading_manager"), "the batch processor")
        cache, offload = processor.cache, processor.offloading_manager
        _require(cache, ("search_prefix_match", "num_blocks"), "the paged cache")
        _require(offload, ("_offload_to_cpu", "restore_scheduled_requests"), "the offloading manager")
        search, offload_to_cpu, restore = (
            cache.search_prefix_match, offload._offload_to_cpu, offload.restore_scheduled_requests)

        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            found = search(request_id, prompt_ids)
            if request_id not in self.hits:  # a restored or re-prefilled request searches again
                self.hits[request_id] = found
                self.stats["prefix_hit_tokens"] += found
            return found

        def _offload_to_cpu(victims: list[Any], *args: Any) -> set[str]:
            swapped = offload_to_cpu(victims, *args)
            self.stats["preemptions"]["swap"] += len(swapped)
            self.stats["preemptions"]["recompute"] += len(victims) - len(swapped)
            for state in victims:
                if state.request_id in swapped:
                    moved = math.ceil(state.position_offset / self.block_size) * self.block_bytes
                    self.swapped_bytes[state.request_id] = moved
                    self.stats["bytes_d2h"] += moved
            return swapped

        def restore_scheduled_requests(requests_in_batch: list[Any]) -> None:
            for future in requests_in_batch:
                if future.state.is_cpu_offloaded:
                    self.stats["bytes_h2d"] += self.swapped_bytes.pop(future.state.request_id, 0)
            return restore(requests_in_batch)

        cache.search_prefix_match = search_prefix_match
        offload._offload_to_cpu = _offload_to_cpu
        offload.restore_scheduled_requests = restore_scheduled_requests


class PeerClient:
    """The workload's client: sends each request to the manager and records what it sees."""

    def __init__(self, manager: Any, counters: PeerCounters, capacity_tokens: int, bar: tqdm,
                 max_requests: int | None) -> None:
        self.manager, self.counters, self.capacity_tokens, self.bar = manager, counters, capacity_tokens, bar
        self.max_requests = max_requests
        self.records: list[RequestRecord] = []

    async def request(self, prompt: list[int] | str, max_tokens: int, tag: str, returning: bool = False) -> list[int]:
        if self.max_requests is not None and len(self.records) >= self.max_requests:
            return []  # a capped smoke run: not sent, not recorded
        record = RequestRecord(tag, time.monotonic(), returning)
        self.records.append(record)
        tokens: list[int] = []
        try:
            tokens = await self._generate(record, prompt, max_tokens, f"{len(self.records) - 1}:{tag}")
        except (ValueError, RuntimeError) as err:
            record.error = str(err)
        self.bar.update(1)
        return tokens

    async def _generate(self, record: RequestRecord, prompt: list[int] | str, max_tokens: int,
                        request_id: str) -> list[int]:
        if isinstance(prompt, str):
            raise ValueError("the transformers peer takes token-id prompts only")
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > self.capacity_tokens:  # transformers would stop the whole manager
            raise ValueError(f"{len(prompt)} + {max_tokens} tokens do not fit the {self.capacity_tokens}-token cache")
        outputs: asyncio.Queue = asyncio.Queue()
        self.manager.register_result_handler(request_id, outputs.put_nowait)  # before the request can answer
        if self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens,
                                    streaming=True, eos_token_id=-1) is None:
            raise RuntimeError("transformers' manager refused the request (stopping or stopped)")
        record.prompt_tokens = len(prompt)
        tokens: list[int] = []
        while True:
            out = await self._next(outputs)
            now = time.monotonic()
            record.token_times += [now] * (len(out.generated_tokens) - len(tokens))
            tokens = list(out.generated_tokens)
            if out.error is not None:
                raise RuntimeError(f"transformers failed the request: {out.error}")
            if out.is_finished():
                record.cached_tokens = self.counters.hits.get(request_id, 0)
                record.output_token_ids, record.finished = tokens, True
                return tokens

    async def _next(self, outputs: asyncio.Queue) -> Any:
        while True:
            try:
                return await asyncio.wait_for(outputs.get(), WATCHDOG_S)
            except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on; this one in 3.10 too
                if not self.manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped (see its log above)") from None


def _workload_hints(workload: Workload, num_requests: int) -> Any:
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        raise RuntimeError(f"transformers {transformers.__version__} has no continuous batching WorkloadHints; "
                           "this benchmark needs transformers 5.17 or later") from None
    prompt_len, new_len = longest_request(workload)
    return WorkloadHints(max_prompt_length=prompt_len, max_generated_length=new_len, num_requests=num_requests)


def start_manager(model: PreTrainedModel, config: EngineConfig, workload: Workload,
                  num_requests: int) -> tuple[Any, PeerCounters, dict[str, Any]]:
    """transformers' manager for the model, sized like our engine, warmed up, counted and started;
    with the settings asked for and resolved (for result.json)."""
    cb_class = _cb_config_class()
    settings = peer_settings(config, {f.name for f in dataclasses.fields(cb_class)})
    hints = _workload_hints(workload, num_requests)
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=hints.max_generated_length,
                                           eos_token_id=-1),
        continuous_batching_config=cb_class(**settings), workload_hints=hints,
    )
    _require(manager, ("warmup", "start", "stop", "destroy", "add_request", "register_result_handler",
                       "is_running"), "ContinuousBatchingManager")
    manager.warmup()  # builds the cache and batch processor (and captures CUDA graphs if it uses them)
    hf = model.config.get_text_config()
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv = KVSpec(hf.num_hidden_layers, hf.num_key_value_heads, head_dim, model.dtype)
    counters = PeerCounters(config.cache.block_size, kv.block_bytes(config.cache.block_size))
    counters.install(manager.batch_processor)
    resolved = manager.continuous_batching_config
    peer = {"engine": "transformers continuous batching", "transformers_version": transformers.__version__,
            "attn_implementation": model.config._attn_implementation, "ttft": TTFT_METHOD, "requested": settings,
            "resolved": {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)}}
    manager.start()
    return manager, counters, peer


async def run_peer(config: EngineConfig, workload: Workload, name: str, attn: str = "sdpa",
                   max_requests: int | None = None, use_tqdm: bool = True) -> tuple[Summary, dict[str, Any]]:
    """Serve the workload with transformers' continuous batching; (summary, result.json document)."""
    model = load_peer_model(config.model, attn)
    num_requests = workload.num_requests if max_requests is None else min(max_requests, workload.num_requests)
    manager, counters, peer = start_manager(model, config, workload, num_requests)
    num_blocks = manager.batch_processor.cache.num_blocks
    try:
        with tqdm(total=num_requests, desc=name, unit="req", disable=not use_tqdm) as bar:
            client = PeerClient(manager, counters, num_blocks * config.cache.block_size, bar, max_requests)
            start = time.monotonic()
            await workload.run(client, model.config.get_text_config().vocab_size)
            elapsed = time.monotonic() - start
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
    stats = {**counters.stats, "gpu_blocks_total": num_blocks}
    summary = summarize(name, client.records, elapsed, stats)
    block_size = config.cache.block_size
    engine = {"config": config.to_dict(), "peer": {**peer, "max_requests": max_requests},
              "tiers": {"gpu": {"blocks": num_blocks, "tokens": num_blocks * block_size,
                                "bytes": num_blocks * counters.block_bytes}},
              "io_backend": None, "cost_model": None, "preemption": "transformers",
              "device": device_name(model.device)}
    document = result_document(name, engine, describe_workload(workload), summary, client.records, start,
                               timeline=[])
    return summary, document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="experiment YAML file (model, dtype, device, seed, cache, scheduler, workload)")
    parser.add_argument("--out", help="result.json path (default results/<name>/transformers/result.json)")
    parser.add_argument("--max-requests", type=int, help="send only the first N requests (a smoke run)")
    parser.add_argument("--attn", default="sdpa",
                        help="attention the model is loaded with; the manager switches it to flash attention when "
                             "that is installed, else to its paged SDPA (5.17: give paged|sdpa to keep SDPA)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    [run] = load_experiment(find_config(args.config), base_only=True).runs
    config, workload = EngineConfig.from_dict(run.engine_doc), run.workload
    config = dataclasses.replace(config, model=locate.resolve(config.model))  # "auto" decided as ours decides it
    name = f"{run.name}/transformers"
    if args.max_requests is not None and args.max_requests < 1:
        parser.error(f"--max-requests: expected a number of requests >= 1, got {args.max_requests}")
    summary, document = asyncio.run(run_peer(config, workload, name, args.attn, args.max_requests,
                                             not args.no_progress))
    out = args.out or os.path.join("results", name, "result.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(document, f, indent=1, default=str)
    print(format_summary(summary))
    print(f"attention: {document['engine']['peer']['attn_implementation']}; wrote {out}")
    return 0 if summary.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
