"""The NVMe store's replacement policy (`cache.nvme_policy`): exact victims of its index under
lru, tinylfu and adaptive (tails of a chain before heads, declined writes), and the real store
on traces built to defeat LRU (cyclic reuse) and TinyLFU (blocks asked for once more), where
adaptive serves what the defeated policy does not; the config key's validation."""

from __future__ import annotations

import pytest
import torch

from tests.reference import make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.cache.hashing import extend_block_hashes
from tieredkv.config import CacheConfig
from tieredkv.tiers.backend import BlockRef
from tieredkv.tiers.nvme.slot_format import SUPERBLOCK_BYTES, SlotGeometry, aligned_empty
from tieredkv.tiers.nvme.slot_index import Declined, Reservation, SlotIndex
from tieredkv.tiers.nvme.store import NVMeStore

BLOCK_SIZE, BLOCK_BYTES = 4, 4096
ROOT = 1 << 40  # the parent of every chain's first block


def stored(index: SlotIndex, *blocks: tuple[int, int | None]) -> None:
    for block_hash, parent in blocks:
        assert isinstance(index.reserve(block_hash, parent), Reservation)
        index.commit(block_hash)


def evictions(index: SlotIndex, new_blocks: range) -> list[int | None]:
    """The victims of writing `new_blocks` (no parents) into a full index, in order."""
    victims = []
    for block_hash in new_blocks:
        reservation = index.reserve(block_hash)
        assert isinstance(reservation, Reservation)
        index.commit(block_hash)
        victims.append(reservation.evicted)
    return victims


# a chain 1 -> 2 -> 3 written head first, an unrelated block 9 between its head and the rest
CHAIN = ((1, ROOT), (9, None), (2, 1), (3, 2))


def test_lru_evicts_the_least_recently_used_whatever_the_chain():
    index = SlotIndex(4, "lru")
    stored(index, *CHAIN)
    assert evictions(index, range(100, 104)) == [1, 9, 2, 3]


@pytest.mark.parametrize("policy", ["adaptive", "tinylfu"])
def test_chain_tail_goes_before_its_head(policy):
    index = SlotIndex(4, policy)
    stored(index, *CHAIN)
    if policy == "tinylfu":  # new blocks asked for more than the residents, so each is admitted
        index.record(list(range(100, 104)) * 2)
    # 1 is the oldest: its chain gives way tail first, then the next oldest, 9
    assert evictions(index, range(100, 104)) == [3, 2, 1, 9]


def test_a_busy_tail_leaves_the_head_to_go():
    index = SlotIndex(3, "adaptive")
    stored(index, (1, ROOT), (2, 1), (3, 2))
    index.pin(3)  # a read of the tail is in flight
    assert evictions(index, range(100, 102)) == [2, 1]  # 3 is busy: 2 has no evictable child
    index.unpin(index.lookup(3))
    assert evictions(index, range(102, 103)) == [3]


def test_restored_blocks_learn_their_parent_when_read():
    index = SlotIndex(2, "adaptive")
    index.restore([(1, 0), (2, 1)])  # the scan knows no parents: plain LRU until read
    assert index.pin(1) == 0 and index.pin(2, parent_hash=1) == 1
    index.unpin(0)
    index.unpin(1)
    assert evictions(index, range(100, 101)) == [2]  # 1 is older, but it is 2's head


def test_tinylfu_declines_a_block_asked_for_less_than_its_victim():
    index = SlotIndex(2, "tinylfu")
    stored(index, (1, None), (2, None))
    index.record([1, 2, 2, 5])
    assert index.reserve(5) == Declined(victim=1)  # a tie keeps the resident
    assert index.stored_hashes() == [1, 2] and not index.known(5)
    index.record([5])
    assert index.reserve(5) == Reservation(slot=0, evicted=1)


def test_adaptive_admits_all_until_its_frequency_ghost_hits_more():
    index = SlotIndex(2, "adaptive")
    stored(index, (1, None), (2, None))
    index.record([1, 2, 2, 5])
    assert index.reserve(5) == Reservation(slot=0, evicted=1)  # no ghost hits yet: LRU
    index.commit(5)
    for block_hash in (1, 2, 5):  # both ghosts hold 1 and 2; the LRU ghost keeps 5, not 1
        index.offered(block_hash)
    index.record([1])  # a hit only in the TinyLFU ghost: admit by frequency from now on
    assert index.policy.by_frequency
    assert index.reserve(7) == Declined(victim=2)


# ---------------------------------------------------------------- the real store on traces


def slots_capacity(num_slots: int) -> int:
    return SUPERBLOCK_BYTES + num_slots * SlotGeometry.for_block(1 << 30, BLOCK_BYTES, BLOCK_SIZE).slot_bytes


class Replay:
    """A real store (sync backend) driven as the CPU tier drives it: offers are written, a
    request is recorded and its leading stored blocks read back (tokens, contents checked)."""

    def __init__(self, path, num_slots: int, policy: str, parents: dict[int, int]) -> None:
        self.store = NVMeStore(path, slots_capacity(num_slots), BLOCK_BYTES, b"fp", BLOCK_SIZE, "sync", policy=policy)
        assert self.store.num_slots == num_slots
        self.parents, self.hits, self.requested = parents, 0, 0
        self.src, self.dst = aligned_empty(BLOCK_BYTES), aligned_empty(BLOCK_BYTES)

    def ref(self, block_hash: int) -> BlockRef:
        return BlockRef(block_hash, self.parents[block_hash], tuple(range(block_hash % 1000, block_hash % 1000 + 4)))

    def offer(self, block_hash: int) -> None:
        self.src.fill_(block_hash % 251)
        job = self.store.submit_write(self.ref(block_hash), self.src)
        if job is not None:
            assert self.store.wait([job]) == {job: True}

    def request(self, blocks: tuple[int, ...]) -> None:
        self.store.record(blocks)
        self.requested += len(blocks)
        for block_hash in blocks[: self.store.contains_run(blocks)]:
            job = self.store.submit_read(self.ref(block_hash), self.dst)
            assert self.store.wait([job]) == {job: True}
            assert torch.all(self.dst == block_hash % 251)
            self.hits += 1


def multi_turn(replay: Replay, users: int, turns: int, first_blocks: int) -> None:
    """Users take turns over more history than the store holds; each turn asks for the user's
    history, then the tier above lets it (and the turn's two new blocks) go, head first."""
    history: dict[int, list[int]] = {u: [] for u in range(users)}
    for turn in range(turns):
        for u in range(users):
            if turn:
                replay.request(tuple(history[u]))
            for _ in range(first_blocks if not turn else 2):
                block = u * 10_000 + len(history[u])
                replay.parents[block] = history[u][-1] if history[u] else ROOT
                history[u].append(block)
            for block in history[u]:
                replay.offer(block)


def once_reused(replay: Replay, conversations: int, turns: int, blocks_per_turn: int) -> None:
    """Each turn asks for the conversation's previous turn (once) and lets its new blocks go,
    tail first: real chat traffic, which frequency admission turns away."""
    previous: dict[int, tuple[int, ...]] = {}
    block = 0
    for _ in range(turns):
        for c in range(conversations):
            if c in previous:
                replay.request(previous[c])
            parent = previous[c][-1] if c in previous else ROOT
            previous[c] = tuple(range(block, block + blocks_per_turn))
            block += blocks_per_turn
            for new in previous[c]:
                replay.parents[new], parent = parent, new
            for new in reversed(previous[c]):
                replay.offer(new)


def hits_by_policy(tmp_path, trace, num_slots: int, **shape: int) -> dict[str, int]:
    found = {}
    for policy in ("lru", "tinylfu", "adaptive"):
        replay = Replay(tmp_path / policy, num_slots, policy, {})
        trace(replay, **shape)
        found[policy] = replay.hits
        stats = replay.store.stats()
        assert stats["policy"] == policy and (stats["write_declined"] > 0) == (policy != "lru")
        replay.store.close()
    return found


def test_adaptive_store_serves_the_cyclic_reuse_that_defeats_lru(tmp_path):
    found = hits_by_policy(tmp_path, multi_turn, 48, users=8, turns=6, first_blocks=10)
    assert found == {"lru": 0, "tinylfu": 240, "adaptive": 192}  # of 560 requested: it follows TinyLFU


def test_adaptive_store_serves_the_once_reused_turns_that_defeat_tinylfu(tmp_path):
    found = hits_by_policy(tmp_path, once_reused, 36, conversations=6, turns=20, blocks_per_turn=4)
    assert found == {"lru": 304, "tinylfu": 36, "adaptive": 304}  # of 456 requested: it follows LRU


def test_nvme_policy_is_validated_like_cpu_policy():
    assert CacheConfig().nvme_policy == "adaptive" and CacheConfig(nvme_policy="lru").nvme_policy == "lru"
    choices = "choose one of 'adaptive', 'tinylfu', 'lru'"
    with pytest.raises(ValueError, match=rf"nvme_policy: 'arc' is not allowed; {choices}"):
        CacheConfig(nvme_policy="arc")
    with pytest.raises(ValueError, match=r"replacement policy 'arc': expected one of adaptive, tinylfu, lru"):
        SlotIndex(4, "arc")


@pytest.mark.parametrize("policy", ["lru", "tinylfu", "adaptive"])
def test_the_engine_builds_its_store_with_nvme_policy_and_tells_it_each_request(policy, tmp_path):
    """`cache.nvme_policy` reaches the store, and each admitted request's prompt blocks past the
    GPU and CPU hits reach the store's policy (a frequency count per block asked of the store)."""
    with LLM(model="tiny-llama", device="cpu", dtype="float32", block_size=4, num_gpu_blocks=24,
             cpu_cache_bytes="32KiB", nvme_path=str(tmp_path / "kv"), nvme_bytes="1MiB", nvme_policy=policy) as llm:
        store = llm.kv.offload.lower.store
        assert store.policy == policy
        prompt = make_prompts(vocab_size=512)[2]  # 16 tokens: 3 full blocks a prefix hit may cover
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        asked = extend_block_hashes([], prompt, 4, llm.kv.root_hash)[: (len(prompt) - 1) // 4]
        counts = None if policy == "lru" else [store.index.policy.count(h) for h in asked]  # lru counts nothing
    assert counts is None or counts == [1] * len(asked) == [1] * 3
