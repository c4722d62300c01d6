"""Finding a sequence's prefix in the tiers, by the content keys of its full blocks.

Operations:
- `BlockKeys(block_size, root_hash)`: a sequence's content keys: `hashes(seq)`,
  `refs(seq, start, stop)` (`BlockRef`s), the hashes a prefix hit may cover,
  `hit_candidates(seq)`, and `found_run(seq, hashes, pool, start)`: the blocks a pool holds for them
  from `start` on, up to the first miss; `forget(seq)` once it is freed.
- `find_prefix(seq, keys, gpu, offload, lower=True) -> PrefixMatch`: the longest run of cached
  full blocks, on the GPU, then in the CPU tier, then (unless `lower` is False) in the lower tier
  (disk, remote).

A prefix hit stops one block short of a full hit: at least one token must be computed to get
logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tieredkv.cache.block_pool import Block, BlockPool
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.cache.offload import CPUOffload
from tieredkv.sequence import Sequence
from tieredkv.tiers.backend import BlockRef


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks holding the first tokens of a sequence: GPU blocks, then CPU blocks,
    then `num_lower` blocks in the lower tier (usable once loaded into the CPU tier; their keys
    are built only for the loads planned, `BlockKeys.refs`, as a waiting request is matched
    again at each step it cannot be admitted)."""

    gpu_blocks: tuple[Block, ...] = ()
    cpu_blocks: tuple[Block, ...] = ()
    num_lower: int = 0

    def num_tokens(self, block_size: int) -> int:
        """Tokens usable now (GPU and CPU hits)."""
        return (len(self.gpu_blocks) + len(self.cpu_blocks)) * block_size


@dataclass(frozen=True)
class _Run:
    """Blocks a pool held for a sequence's full blocks from block `start` on, and the token
    tuples they held then (found equal to the sequence's). A block still cached under the same
    hash, with the same parent and that very tuple (a tuple never changes), still holds that
    content: `BlockPool.lookup` would find it again."""

    start: int
    blocks: list[Block]
    tokens: list[tuple[int, ...] | None]

    def still_held(self, hashes: list[int], parent: int) -> list[Block]:
        """The leading blocks of the run the pool still holds, with the same content (`parent`:
        the hash before the first)."""
        held = []
        for i, (block, tokens) in enumerate(zip(self.blocks, self.tokens, strict=True), self.start):
            if block.block_hash != hashes[i] or block.parent_hash != parent or block.token_ids is not tokens:
                break
            held.append(block)
            parent = hashes[i]
        return held


class BlockKeys:
    """The content keys of sequences' full blocks: chained hashes from `root_hash` (the
    model's fingerprint), each with its parent hash and tokens."""

    def __init__(self, block_size: int, root_hash: int) -> None:
        self.block_size = block_size
        self.root_hash = root_hash
        self._runs: dict[str, dict[int, _Run]] = {}  # sequence -> id of a pool -> the run found there last

    def hashes(self, seq: Sequence) -> list[int]:
        """The hashes of the sequence's full blocks (hashed once, kept by the sequence)."""
        return extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, self.root_hash)

    def hit_candidates(self, seq: Sequence) -> list[int]:
        """The hashes of the sequence's full blocks that a prefix hit may cover."""
        return self.hashes(seq)[: (seq.num_tokens - 1) // self.block_size]

    def found_run(self, seq: Sequence, hashes: list[int], pool: BlockPool, start: int = 0) -> list[Block]:
        """The blocks `pool` holds with exactly the content of the sequence's full blocks from
        `start` on, up to the first it lacks, of those `hashes` name (`hit_candidates(seq)`:
        those a prefix hit may cover). A waiting request is matched again at each step it cannot
        be admitted: the run found last time (`_Run`) is checked block by block without
        comparing tokens again, and only what follows it is looked up."""
        if start >= len(hashes):
            return []
        runs = self._runs.setdefault(seq.seq_id, {})
        last = runs.get(id(pool))
        first_parent = hashes[start - 1] if start else self.root_hash
        found = last.still_held(hashes, first_parent) if last is not None and last.start == start else []
        bs, tokens = self.block_size, seq.token_ids
        first = start + len(found)
        parent = hashes[first - 1] if first else self.root_hash
        for i in range(first, len(hashes)):
            block = pool.lookup(hashes[i], parent, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            found.append(block)
            parent = hashes[i]
        runs[id(pool)] = _Run(start, found, [b.token_ids for b in found])
        return found

    def forget(self, seq: Sequence) -> None:
        """The sequence is freed: drop the runs found for it."""
        self._runs.pop(seq.seq_id, None)

    def refs(self, seq: Sequence, start: int, stop: int) -> Iterator[BlockRef]:
        """Content keys of the sequence's full blocks `start` to `stop - 1`."""
        bs = self.block_size
        hashes = self.hashes(seq)
        for i in range(start, stop):
            parent = hashes[i - 1] if i else self.root_hash
            yield BlockRef(hashes[i], parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))


def find_prefix(seq: Sequence, keys: BlockKeys, gpu: BlockPool, offload: CPUOffload | None,
                lower: bool = True) -> PrefixMatch:
    """The sequence's prefix found in each tier, in order: GPU blocks, then CPU blocks, then
    (with `lower`) blocks in the lower tier. Costs the blocks found, not the prompt (a waiting
    request is matched again at each step it cannot be admitted)."""
    hashes = keys.hit_candidates(seq)
    gpu_blocks = keys.found_run(seq, hashes, gpu)
    if offload is None or len(gpu_blocks) == len(hashes):
        return PrefixMatch(tuple(gpu_blocks))
    cpu_blocks = keys.found_run(seq, hashes, offload.pool, len(gpu_blocks))
    start = len(gpu_blocks) + len(cpu_blocks)
    if start == len(hashes) or offload.lower is None or not lower:
        return PrefixMatch(tuple(gpu_blocks), tuple(cpu_blocks))
    # the store verifies parent and tokens when it reads the block
    stop = offload.lower.held_run(hashes, start)
    return PrefixMatch(tuple(gpu_blocks), tuple(cpu_blocks), stop - start)
