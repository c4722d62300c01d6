"""Finding a sequence's prefix in the tiers, by the content keys of its full blocks.

Operations:
- `BlockKeys(block_size, root_hash)`: a sequence's content keys: `hashes(seq)`,
  `refs(seq, start, stop)` (`BlockRef`s), and the ones a prefix hit may cover,
  `hit_candidates(seq)` / `hit_refs(seq, start)`.
- `find_prefix(seq, keys, gpu, offload) -> PrefixMatch`: the longest run of cached full
  blocks, on the GPU, then in the CPU tier, then in the lower tier (disk, remote).
- `run_of(refs, lookup)`: the blocks a lookup finds for the first refs, up to the first miss.

A prefix hit stops one block short of a full hit: at least one token must be computed to get
logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.cache.offload import CPUOffload
from tieredkv.sequence import Sequence
from tieredkv.tiers.backend import BlockRef


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks holding the first tokens of a sequence: GPU blocks, then CPU blocks,
    then blocks in the lower tier (usable once loaded into the CPU tier)."""

    gpu_blocks: tuple[Block, ...] = ()
    cpu_blocks: tuple[Block, ...] = ()
    lower_refs: tuple[BlockRef, ...] = ()

    def num_tokens(self, block_size: int) -> int:
        """Tokens usable now (GPU and CPU hits)."""
        return (len(self.gpu_blocks) + len(self.cpu_blocks)) * block_size


class BlockKeys:
    """The content keys of sequences' full blocks: chained hashes from `root_hash` (the
    model's fingerprint), each with its parent hash and tokens."""

    def __init__(self, block_size: int, root_hash: int) -> None:
        self.block_size = block_size
        self.root_hash = root_hash

    def hashes(self, seq: Sequence) -> list[int]:
        """The hashes of the sequence's full blocks (hashed once, kept by the sequence)."""
        return extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.root_hash)

    def hit_candidates(self, seq: Sequence) -> list[int]:
        """The hashes of the sequence's full blocks that a prefix hit may cover."""
        return self.hashes(seq)[: (seq.num_tokens - 1) // self.block_size]

    def hit_refs(self, seq: Sequence, start: int = 0) -> Iterator[BlockRef]:
        """The keys of the sequence's full blocks from block `start` on that a prefix hit may cover."""
        return self.refs(seq, start, (seq.num_tokens - 1) // self.block_size)

    def refs(self, seq: Sequence, start: int, stop: int) -> Iterator[BlockRef]:
        """Content keys of the sequence's full blocks `start` to `stop - 1`."""
        bs = self.block_size
        hashes = self.hashes(seq)
        for i in range(start, stop):
            parent = hashes[i - 1] if i else self.root_hash
            yield BlockRef(hashes[i], parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))


def find_prefix(seq: Sequence, keys: BlockKeys, gpu: BlockPool, offload: CPUOffload | None) -> PrefixMatch:
    """The sequence's prefix found in each tier, in order: GPU blocks, then CPU blocks, then
    blocks in the lower tier. Costs the blocks found, not the prompt (a waiting request is
    matched again at each step it cannot be admitted)."""
    refs = keys.hit_refs(seq)
    gpu_blocks, miss = run_of(refs, gpu.lookup)
    if offload is None or miss is None:
        return PrefixMatch(tuple(gpu_blocks))
    cpu_blocks, miss = run_of(itertools.chain([miss], refs), offload.lookup)
    if miss is None or offload.lower is None:
        return PrefixMatch(tuple(gpu_blocks), tuple(cpu_blocks))
    # the store verifies parent and tokens when it reads the block
    start = len(gpu_blocks) + len(cpu_blocks)
    stop = offload.lower.held_run(keys.hit_candidates(seq), start)
    return PrefixMatch(tuple(gpu_blocks), tuple(cpu_blocks), tuple(keys.refs(seq, start, stop)))


def run_of(refs: Iterator[BlockRef],
           lookup: Callable[[int, int, tuple[int, ...]], Block | None]) -> tuple[list[Block], BlockRef | None]:
    """The blocks `lookup` finds for the first of `refs`, up to the first miss, and that miss
    (None: every ref was found); what follows the miss is left in `refs`."""
    found = []
    for ref in refs:
        block = lookup(ref.block_hash, ref.parent_hash, ref.token_ids)
        if block is None:
            return found, ref
        found.append(block)
    return found, None
