"""How the tensor-parallel ranks sum a tensor (the row-parallel layers' partial outputs).

`torch.distributed.all_reduce` (NCCL on CUDA, gloo on the CPU) pays a fixed cost per call (its
launch, its protocol's handshakes) that small messages do not amortize. Small messages between
GPUs that can read each other's memory go instead through a one-shot all-reduce in PyTorch's
symmetric memory (`torch.ops.symm_mem.one_shot_all_reduce_copy_out`, one kernel): every rank
copies its input into its buffer, a barrier over the signal pads, every rank reads all buffers
through peer pointers and sums them.

    rank 0: x0 ─copy─► buf0 ─┐ barrier ┌─ out = buf0 + buf1   (each rank reads the peer's buffer
    rank 1: x1 ─copy─► buf1 ─┘         └─ out = buf0 + buf1    over NVLink, its own locally)

The buffer is allocated and rendezvoused once, before any CUDA graph is captured; the op then
records into graphs like any kernel. NVLink multicast (`multimem` ops) is never used: the
process sets `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` before its first rendezvous, so no multicast
object is created.

Operations: `make_all_reduce(mode, device, dtype, max_elements, group)` (collective: every rank
calls it, after `init_process_group`), `AllReduce(x)` -> the sum, `AllReduce.description`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from tieredkv.config import AllReduceMode

logger = logging.getLogger(__name__)

# Messages up to this size take the one-shot path. It covers a decode step of up to 256
# sequences at hidden size 4096 in bf16 (256 x 4096 x 2 B = 2 MiB) while prefill chunks (2048
# tokens: 16 MiB) stay on NCCL, whose ring spreads large messages over all its channels; the
# one-shot kernel reads the whole peer buffer with at most 24 thread blocks (torch's launch
# cap). vLLM's custom all-reduce also runs one-shot on two GPUs at every size it takes. Not yet
# timed beyond a decode step: benchmarks/bench_tp.py compares both paths at `--batch` tokens
# (64: 512 KiB; 256: 2 MiB), and the limit belongs where they cross.
ONE_SHOT_MAX_BYTES = 2 << 20
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what the symm_mem reduce kernels dispatch on
_VECTOR_BYTES = 16  # the op wants input and buffer (16-byte aligned) at one vector alignment


class OneShot:
    """A one-shot all-reduce over `buffer`, a symmetric-memory tensor of bytes rendezvoused
    over the group named `group_name` (the same size on every rank)."""

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer
        self.group_name = group_name

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` fits the buffer and the kernel. It reads only `x`'s size, dtype and
        layout, alike on every rank, so all ranks take the same path."""
        nbytes = x.numel() * x.element_size()
        return (
            x.is_cuda and x.dtype in ONE_SHOT_DTYPES and x.is_contiguous()
            and 0 < nbytes <= self.buffer.numel() and nbytes % 4 == 0
            and x.storage_offset() * x.element_size() % _VECTOR_BYTES == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in a new tensor (`x` is left as it is)."""
        assert self.takes(x), f"one-shot all-reduce given a {x.dtype} tensor of shape {tuple(x.shape)} it cannot take"
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)


class AllReduce:
    """Sums a tensor over the ranks of `group` (None: the default group): through `one_shot`
    when it takes the tensor, else `dist.all_reduce`. `description` says which, and why."""

    def __init__(self, group: dist.ProcessGroup | None = None, one_shot: OneShot | None = None,
                 description: str = "torch.distributed all-reduce") -> None:
        self.group = group
        self.one_shot = one_shot
        self.description = description

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks: `x` itself, summed in place, or a new tensor."""
        if self.one_shot is not None and self.one_shot.takes(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x


def make_all_reduce(
    mode: AllReduceMode, device: torch.device, dtype: torch.dtype, max_elements: int,
    group: dist.ProcessGroup | None = None,
) -> AllReduce:
    """The all-reduce of a rank whose largest message is `max_elements` of `dtype`: with
    `mode` "auto" on GPUs that reach each other, a one-shot path for messages up to
    `ONE_SHOT_MAX_BYTES`; NCCL (gloo) for the rest and wherever it cannot be set up (logged
    at info, with the reason). Collective: every rank of `group` calls it, in the same order."""
    nbytes = min(ONE_SHOT_MAX_BYTES, max_elements * dtype.itemsize)
    reason = _one_shot_refused(mode, device, dtype, group)
    one_shot = None
    if reason is None:
        one_shot, reason = _set_up_one_shot(nbytes, group)
    if one_shot is None:
        description = f"torch.distributed all-reduce only ({reason})"
    else:
        description = f"one-shot all-reduce in symmetric memory up to {nbytes} bytes, torch.distributed above"
    logger.info("tensor parallelism: %s", description)
    return AllReduce(group, one_shot, description)


def _one_shot_refused(
    mode: AllReduceMode, device: torch.device, dtype: torch.dtype, group: dist.ProcessGroup | None
) -> str | None:
    """Why the one-shot path is not for this group, or None. Every rank sees the same answer
    but for peer access, which they agree on."""
    if mode != "auto":
        return f"all_reduce: {mode}"
    if device.type != "cuda":
        return f"device {device.type}: the one-shot path needs GPUs"
    if dist.get_world_size(group) == 1:
        return "one rank"
    if dtype not in ONE_SHOT_DTYPES:
        return f"dtype {dtype}: the one-shot kernels take bfloat16 and float32"
    if not _agree(_reaches_every_peer(group), group):
        return "a GPU of the group cannot read another's memory (no peer access)"
    return None


def _reaches_every_peer(group: dist.ProcessGroup | None) -> bool:
    """Whether this rank's GPU has peer access to every other rank's GPU."""
    mine = torch.tensor([torch.cuda.current_device()], device="cuda")
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    peers = {int(t.item()) for t in every} - {int(mine.item())}
    return all(torch.cuda.can_device_access_peer(int(mine.item()), peer) for peer in peers)


def _set_up_one_shot(nbytes: int, group: dist.ProcessGroup | None) -> tuple[OneShot | None, str]:
    """Allocate the symmetric buffer, rendezvous it, check one sum: (the one-shot path, "") or
    (None, why). The ranks agree after each stage, so that none waits in a rendezvous or a
    barrier that another rank skipped."""
    import torch.distributed._symmetric_memory as symm_mem

    # no NVLink multicast object: the one-shot kernel reads peers through P2P pointers only
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    group_name = (group or dist.group.WORLD).group_name
    device = torch.device("cuda", torch.cuda.current_device())
    buffers: list[torch.Tensor] = []  # what the allocation stage made

    def allocate() -> None:
        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018 (AttributeError on a torch without it)
        buffers.append(symm_mem.empty(nbytes, dtype=torch.uint8, device=device))

    stages = (
        ("symmetric memory allocation", allocate),
        ("symmetric memory rendezvous", lambda: symm_mem.rendezvous(buffers[0], group_name)),
        ("one-shot all-reduce check", lambda: _check_sum(OneShot(buffers[0], group_name), group)),
    )
    for stage, step in stages:
        why = _failure_on_any_rank(stage, step, group)
        if why:
            return None, why
    return OneShot(buffers[0], group_name), ""


def _failure_on_any_rank(stage: str, step: Callable[[], object], group: dist.ProcessGroup | None) -> str:
    """Run `step` on this rank; "" if it succeeded on every rank, else why not."""
    try:
        step()
        error = None
    except (RuntimeError, AttributeError) as err:  # AttributeError: a torch without symm_mem ops
        error = err
    if _agree(error is None, group):
        return ""
    return f"{stage} failed: {error or 'on another rank'}"


def _check_sum(one_shot: OneShot, group: dist.ProcessGroup | None) -> None:
    """One one-shot all-reduce of ones, eagerly (its kernel is loaded before any graph capture)."""
    ones = torch.ones(8, dtype=torch.float32, device="cuda")
    total = one_shot(ones)
    world = dist.get_world_size(group)
    if not bool((total == world).all()):
        raise RuntimeError(f"one-shot all-reduce of ones over {world} ranks gave {total.tolist()}")


def _agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether `ok` holds on every rank (a collective over `group`)."""
    flag = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
