"""`Workers`: the model runner of an engine with `tensor_parallel_size` > 1.

It stands where a `ModelRunner` stands in the engine and answers what the engine asks of one
(the model's architecture, tokenizer, EOS ids, KV size per block, a GPU tier, its CPU twin and
transfers, a forward pass), while each rank's process holds its share of the model and of the
KV. The driver keeps the scheduler and every block table; block ids are the same on every rank.

Operations (besides the `ModelRunner` ones):
- `copy_blocks(copies)`: copy-on-write block copies, run on every rank with the next step.
- `execute(scheduled, tables, sampling) -> Drawn`: one step on every rank; rank 0 draws the
  tokens, logprobs and beam candidates (`Decoder.draws` says what).
- `open_store(cache, fingerprint)`: the NVMe tier, one store file per rank.
- `open_remote(cache, fingerprint)`: the remote tier, one key per rank and block.
- `calibrate(fingerprint, max_tokens, max_context_tokens, disk)`: the cost model, measured on the ranks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from tieredkv.calibrate import DiskProbe, calibrate
from tieredkv.config import CacheConfig, EngineConfig
from tieredkv.model.runner import (
    KVSpec,
    StepInputs,
    eos_token_ids,
    load_generation_config,
    load_hf_config,
    load_tokenizer,
    max_model_len,
    weights_identity,
)
from tieredkv.model.sharding import TPLayout
from tieredkv.parallel.plan import Draw, Drawn, NewRequest, StepPlan
from tieredkv.parallel.ranks import RankFailure, Ranks
from tieredkv.parallel.sharded_remote import ShardedRemote, open_sharded_remote
from tieredkv.parallel.sharded_tiers import ShardedCPUTier, ShardedStore, open_sharded_store
from tieredkv.parallel.transfers import WorkerTransfers
from tieredkv.parallel_sampling import SampleGroup
from tieredkv.policy import CostModel
from tieredkv.sequence import ScheduledSeq
from tieredkv.sequence import Sequence as Seq

__all__ = ["RankFailure", "Workers"]

logger = logging.getLogger(__name__)


class Workers:
    """`tensor_parallel_size` rank processes behind the model runner's interface."""

    def __init__(self, config: EngineConfig) -> None:
        """`config.model` resolved; the ranks start and load their shards before this returns."""
        model = config.model
        self.config = model
        world = config.parallel.tensor_parallel_size
        self.device = torch.device(model.device)
        self.hf_config = load_hf_config(model.model)
        layout = TPLayout(0, world)
        layout.check(self.hf_config)
        if self.device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size: {world} ranks need {world} GPUs, {torch.cuda.device_count()} are visible; "
                "lower it (or make more GPUs visible with CUDA_VISIBLE_DEVICES)"
            )
        self.tp_layout = layout.describe(self.hf_config)
        self.tokenizer: PreTrainedTokenizerBase | None = load_tokenizer(model.model)
        self.eos_token_ids = eos_token_ids(self.hf_config, load_generation_config(model.model, self.hf_config))
        self.max_model_len = max_model_len(model.max_model_len, self.hf_config.max_position_embeddings)
        self.weights_id = weights_identity(model)
        self.rank_kv_spec = KVSpec.of(self.hf_config, model.dtype, layout)
        # a block's KV on all ranks together (replicated KV heads counted once per rank)
        self.kv_spec = dataclasses.replace(self.rank_kv_spec, num_kv_heads=self.rank_kv_spec.num_kv_heads * world)
        self.block_size = 0
        self.transfers: WorkerTransfers | None = None
        self._known: dict[str, Seq] = {}  # requests rank 0 holds the parameters (and generators) of, by first seq
        self._copies: tuple[tuple[int, int], ...] = ()  # copy-on-write copies for the next step
        self.ranks = Ranks(config, world)
        info = self.ranks.info
        assert all(i["kv_spec"] == self.rank_kv_spec for i in info), "the ranks hold the KV heads planned here"
        self.device_name = f"{info[0]['device_name']} x{world}"
        logger.info("%d tensor-parallel ranks (pids %s) on %s: %s", world, self.pids, self.device_name, self.tp_layout)

    @property
    def world(self) -> int:
        return self.ranks.world

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        return [i["pid"] for i in self.ranks.info]

    # ------------------------------------------------------------------ tiers

    def num_gpu_blocks(self, cache: CacheConfig) -> int:
        """The GPU tier's blocks: what every rank's GPU holds (each its KV heads of them)."""
        return min(self.ranks.call("num_gpu_blocks", cache, settings=True))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.ranks.call("allocate_kv_cache", num_blocks, block_size)
        self.block_size = block_size

    def cpu_tier(self, num_blocks: int) -> tuple[ShardedCPUTier, WorkerTransfers]:
        """The CPU tier, one slice per rank in memory shared with it, and the transfers."""
        s = self.rank_kv_spec
        tier = ShardedCPUTier(num_blocks, (s.num_layers, 2, self.block_size, s.num_kv_heads, s.head_dim),
                              s.dtype, self.world)
        try:
            self.ranks.call("attach_cpu_tier", num_blocks, tier.rank_nbytes, handles=tier.fds)
        finally:
            tier.close_fds()
        self.transfers = WorkerTransfers(self.ranks, self.kv_spec.block_bytes(self.block_size))
        return tier, self.transfers

    def open_store(self, cache: CacheConfig, fingerprint: int) -> ShardedStore:
        return open_sharded_store(cache, self.rank_kv_spec.block_bytes(cache.block_size), fingerprint, self.world)

    def open_remote(self, cache: CacheConfig, fingerprint: int) -> ShardedRemote:
        return open_sharded_remote(cache, self.rank_kv_spec.block_bytes(cache.block_size), fingerprint, self.world)

    def capture_graphs(self, max_batch: int) -> None:
        self.ranks.call("capture_graphs", max_batch)

    # ------------------------------------------------------------------ steps

    def execute(
        self, scheduled: Sequence[ScheduledSeq], block_tables: Sequence[list[int]], sampling: Sequence[Seq],
        draws: Sequence[Draw],
    ) -> Drawn:
        """Run the scheduled tokens on every rank (after the transfers submitted since the last
        step, and the block copies); rank 0 takes `draws[i]` from the row of `sampling[i]`."""
        inputs = StepInputs.build(scheduled, block_tables, self.block_size)
        forget = self._forget()
        requests = (s.group.first if s.group is not None else s for s in sampling)  # by their first sequences
        firsts = {id(f): f for f in requests if self._known.get(f.request_id) is not f}
        step = dict(copies=self._copies, inputs=inputs, draws=tuple(draws), forget=forget,
                    new_requests=tuple(map(self._learn, firsts.values())))
        self._copies = ()
        plan = StepPlan(**step) if self.transfers is None else self.transfers.plan(**step)
        replies = self.ranks.call("step", plan)
        if self.transfers is not None:
            self.transfers.record(replies)
        return replies[0].drawn

    def _learn(self, first: Seq) -> NewRequest:
        """A request rank 0 has not seen (or a new one under a finished one's id), by its
        first sequence: its parameters, and the seed of each sample's generator."""
        self._known[first.request_id] = first
        generators = first.group.generators if isinstance(first.group, SampleGroup) else [first.generator]
        return NewRequest(first.request_id, first.params,
                          tuple(None if g is None else g.initial_seed() for g in generators))

    def _forget(self) -> tuple[str, ...]:
        """Requests that finished since the last step: rank 0 drops what it holds of them."""
        done = tuple(rid for rid, first in self._known.items()
                     if (first.group.finished if first.group is not None else first.is_finished))
        for rid in done:
            del self._known[rid]
        return done

    def prefill_probe(self, num_tokens: int, context_tokens: int = 0) -> None:
        """A forward pass of `num_tokens` after `context_tokens` cached ones on every rank;
        returns once all have finished."""
        self.ranks.call("prefill_probe", num_tokens, context_tokens)

    def measure_bandwidth(self) -> tuple[float, float]:
        """(D2H, H2D) bytes/s of all ranks copying at once (each over its own link)."""
        each = self.ranks.call("measure_bandwidth")
        return sum(d for d, _ in each), sum(h for _, h in each)

    def calibrate(
        self, fingerprint: int, max_tokens: int, max_context_tokens: int, disk: DiskProbe | None,
    ) -> CostModel:
        """The cost model: swaps move every rank's bytes at once, so their bandwidths add up;
        the disk is read as the ranks' stores read it (one rank's slices, every store's queue)."""
        key = f"{self.device_name}/{fingerprint:016x}"
        if disk is not None:
            rank_bytes = self.rank_kv_spec.block_bytes(self.block_size)
            disk = disk._replace(read_bytes=rank_bytes, queue_depth=disk.queue_depth * self.world)
        return calibrate(key, torch.device("cpu"), self.prefill_probe, max_tokens, disk, self.measure_bandwidth,
                         max_context_tokens)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block `src` into `dst` for each `(src, dst)` on every rank (its KV heads), with
        the next step's plan: after its transfers are ordered, before its forward pass."""
        assert not self._copies, "block copies are taken once per step, before its forward pass"
        self._copies = tuple(copies)

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        self.ranks.shutdown()
