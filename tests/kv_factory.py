"""The scheduler and the KV cache manager on small CPU tensors, with no model (in the spirit of
SGLang's simulated pools): `make_kv` builds the tiers, `run_step` plays one engine step with a
fake forward pass that writes each token's id into its KV slots, so that a test can check that
every sequence reads back exactly its own tokens, whatever the tiers did."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tieredkv.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref

from tieredkv.cache.manager import KVCacheManager
from tieredkv.cache.offload import CPUOffload
from tieredkv.config import SchedulerConfig
from tieredkv.policy import CostModel, Preemption, TierPolicy
from tieredkv.replacement import ReplacementPolicy
from tieredkv.sampling import SamplingParams
from tieredkv.scheduler import Scheduler, SchedulerOutput
from tieredkv.sequence import Sequence
from tieredkv.tiers.cpu import CPUTier
from tieredkv.tiers.nvme import NVMeStore
from tieredkv.tiers.nvme.block_io import BlockIO
from tieredkv.tiers.nvme.io_backends import IOBackend
from tieredkv.transfer.engine import FaultyTransfers, TransferEngine

BS = 4
ROOT = 7
BLOCK_SHAPE = (2, 2, BS, 2, 32)  # [layers, K/V, block_size, kv_heads, head_dim]: 4 KiB in float32
BLOCK_BYTES = 4096


@dataclass
class SimKV:
    """A KV cache manager and the tensors behind it."""

    kv: KVCacheManager
    gpu: torch.Tensor  # [layers, 2, num_gpu_blocks, block_size, kv_heads, head_dim]
    transfers: FaultyTransfers | None


def make_kv(num_gpu_blocks: int, num_cpu_blocks: int = 0, nvme_path: str | None = None,
            nvme_blocks: int = 64, cpu_policy: ReplacementPolicy = "tinylfu",
            backend: IOBackend | BlockIO = "sync") -> SimKV:
    """GPU (and CPU, and NVMe) tiers of the given sizes, in ordinary memory."""
    layers, _, bs, heads, dim = BLOCK_SHAPE
    gpu = torch.zeros((layers, 2, num_gpu_blocks, bs, heads, dim))
    if not num_cpu_blocks:
        return SimKV(KVCacheManager(num_gpu_blocks, BS, ROOT), gpu, None)
    tier = CPUTier(num_cpu_blocks, BLOCK_SHAPE, gpu.dtype, pin=False)
    transfers = FaultyTransfers(TransferEngine(gpu, tier.data))
    store = None
    if nvme_path is not None:
        store = NVMeStore(nvme_path, (nvme_blocks + 1) * 2 * BLOCK_BYTES, BLOCK_BYTES, ROOT, BS, backend=backend)
    offload = CPUOffload(tier, transfers, store, cpu_policy)
    return SimKV(KVCacheManager(num_gpu_blocks, BS, ROOT, offload), gpu, transfers)


def make_scheduler(sim: SimKV, preemption: Preemption = "recompute", cost: CostModel | None = None,
                   max_num_seqs: int = 8, max_num_batched_tokens: int = 64, **scheduling: Any) -> Scheduler:
    """A scheduler over `sim`; `scheduling`: more SchedulerConfig keys. The scenarios' exact
    orders assume arrival order (`fcfs`) unless a test names another `scheduling_policy`."""
    scheduling = {"scheduling_policy": "fcfs", **scheduling}
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **scheduling)
    return Scheduler(config, sim.kv, TierPolicy(preemption, BLOCK_BYTES, BS, cost))


def make_seq(rid: str, tokens: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def next_token(seq: Sequence) -> int:
    """The token a scripted step samples: a function of the sequence's length and id."""
    return (seq.num_tokens * 7 + len(seq.request_id)) % 97


def run_step(sched: Scheduler, sim: SimKV, sample: Callable[[Sequence], int] = next_token) -> SchedulerOutput:
    """One engine step: schedule, run the copy-on-write block copies, check the KV every
    scheduled sequence reads, write the KV of its new tokens, `sample` their tokens, update."""
    sim.kv.retire()
    out = sched.schedule()
    if not out.scheduled:
        time.sleep(0.001)  # waiting for NVMe reads: let the I/O threads run
    sim.kv.before_forward()
    copy_blocks(sim, sim.kv.take_block_copies())
    for item in out.scheduled:
        check_kv(sim, item.seq)
        write_kv(sim, item.seq, item.num_new_tokens)
    sched.update(out, [sample(seq) for seq in out.sampling])
    return out


def write_kv(sim: SimKV, seq: Sequence, num_new_tokens: int) -> None:
    """The forward pass's writes: the KV of each of the sequence's next `num_new_tokens` tokens
    holds the token."""
    table = sim.kv.block_table(seq)
    start = seq.num_computed_tokens
    for pos in range(start, start + num_new_tokens):
        sim.gpu[:, :, table[pos // BS], pos % BS] = float(seq.token_ids[pos])


def copy_blocks(sim: SimKV, copies: list[tuple[int, int]]) -> None:
    """The model runner's copy-on-write copies, with the block-copy kernels' torch twins."""
    if not copies:
        return
    src, dst = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*copies, strict=True))
    layers, _, bs, heads, dim = BLOCK_SHAPE
    staging = torch.empty((len(copies), layers, 2, bs, heads, dim))
    gather_blocks_ref(sim.gpu, src, staging)
    scatter_blocks_ref(staging, sim.gpu, dst)


def check_kv(sim: SimKV, seq: Sequence) -> None:
    """The KV of the sequence's computed tokens holds exactly those tokens."""
    table = sim.kv.block_table(seq)
    for pos in range(seq.num_computed_tokens):
        got = sim.gpu[:, :, table[pos // BS], pos % BS]
        assert torch.all(got == seq.token_ids[pos]), f"{seq.request_id}: KV of token {pos} is wrong"


def run_until_done(sched: Scheduler, sim: SimKV, max_steps: int = 500) -> list[SchedulerOutput]:
    steps = []
    while sched.has_unfinished():
        steps.append(run_step(sched, sim))
        assert len(steps) < max_steps, "the scheduler made no progress"
    return steps
