"""Block pool and KV cache manager: exact block ids, LRU eviction order, invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tieredkv.cache.block_pool import BlockPool
from tieredkv.cache.manager import KVCacheManager
from tieredkv.sampling import SamplingParams
from tieredkv.sequence import Sequence

BS = 4


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4, temperature=0.0))


def run_prefill(kv: KVCacheManager, seq: Sequence) -> list[int]:
    """Admit a sequence the way the scheduler does and mark its prompt computed."""
    prefix = kv.match_prefix(seq)
    got = kv.allocate(seq, seq.num_tokens - prefix.num_tokens(BS), prefix)
    assert got is not None
    seq.num_cached_tokens = got.num_cached_tokens
    seq.num_computed_tokens = seq.num_tokens
    kv.commit(seq)
    return kv.block_table(seq)


def test_allocate_takes_blocks_in_order_and_fails_without_side_effects():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free == 1


def test_a_pinned_block_is_never_allocated_and_keeps_its_place():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks):
        pool.cache(block, 100 + i, 0, (i,))
    pool.release(blocks)  # LRU order: 0, 1, 2, 3; block 4 empty
    pool.pin(blocks[0])
    assert pool.num_free == 4 and not pool.is_free(blocks[0])
    assert [b.block_id for b in pool.cold_blocks()] == [1, 2, 3]
    assert [b.block_id for b in pool.allocate(2)] == [4, 1]  # the empty one, then past the pinned one
    assert pool.cached_block(100) is blocks[0] and pool.allocate(3) is None
    pool.touch(blocks[0])  # found again while pinned: owned, then released to the back
    pool.release([blocks[0]])
    assert [b.block_id for b in pool.cold_blocks()] == [2, 3] and pool.num_free == 2
    pool.unpin(blocks[0])
    assert pool.num_free == 3 and [b.block_id for b in pool.allocate(3)] == [2, 3, 0]


def test_unpinned_the_block_is_taken_where_it_stood():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache(block, 100 + i, 0, (i,))
    pool.release(blocks)
    pool.pin(blocks[0])
    assert [b.block_id for b in pool.allocate(1)] == [1]
    pool.unpin(blocks[0])
    assert [b.block_id for b in pool.free_blocks()] == [0, 2]  # still first in line


def test_a_block_pinned_while_owned_is_not_free_once_released():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], 100, 0, (0,))
    pool.pin(blocks[0])  # written to disk while a sequence still owns it
    assert pool.num_free == 1
    pool.release(blocks)
    assert pool.num_free == 2 and [b.block_id for b in pool.free_blocks()] == [1, 2]
    pool.uncache(blocks[0])  # forgotten while pinned: an empty block, still not free
    assert pool.num_free == 2 and pool.allocate(3) is None
    pool.unpin(blocks[0])
    assert pool.num_free == 3 and [b.block_id for b in pool.allocate(3)] == [0, 1, 2]


def test_expendable_blocks_go_after_the_empty_ones_and_before_the_kept_ones():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.cache(block, 100 + i, 0, (i,))
    pool.release(blocks[:3])  # kept, LRU order: 0, 1, 2
    for block in blocks[3:]:  # content safe elsewhere: 4 is released last, so it goes first
        block.evict_first = True
    pool.release(blocks[3:])
    assert [b.block_id for b in pool.free_blocks()] == [5, 4, 3, 0, 1, 2]
    assert pool.next_victim().block_id == 5 and pool.next_kept_victim() is blocks[0]
    pool.pin(blocks[0])
    assert pool.next_kept_victim() is blocks[1] and pool.num_free == 5
    pool.refresh(blocks[4])  # used again: the last to be evicted, among the kept ones
    assert [b.block_id for b in pool.cold_blocks()] == [3, 1, 2, 4]
    pool.uncache(blocks[3])  # forgotten: an empty block, taken first
    assert [b.block_id for b in pool.allocate(2)] == [3, 5] and pool.cached_block(103) is None
    assert [b.block_id for b in pool.free_blocks()] == [1, 2, 4] and pool.num_free == 3


def test_uncached_blocks_are_reused_before_cached_ones():
    kv = KVCacheManager(num_blocks=6, block_size=BS, root_hash=7)
    a = make_seq("a", list(range(10)))  # 2 full blocks + 1 partial
    assert run_prefill(kv, a) == [0, 1, 2]
    kv.free(a)
    # the partial block 2 has no hash: it goes to the front; full blocks 1 then 0 go to the back
    assert [b.block_id for b in kv.pool.free_blocks()] == [2, 3, 4, 5, 1, 0]
    b = make_seq("b", [100 + i for i in range(12)])
    assert run_prefill(kv, b) == [2, 3, 4]
    assert kv.pool.num_cached == 5  # a's two blocks and b's three


def test_prefix_hits_and_lru_eviction_order():
    kv = KVCacheManager(num_blocks=5, block_size=BS, root_hash=7)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]  # two full blocks
    a = make_seq("a", shared + [1, 1])
    assert run_prefill(kv, a) == [0, 1, 2]
    b = make_seq("b", shared + [2, 2, 2])
    assert run_prefill(kv, b) == [0, 1, 3]  # two blocks reused from a
    assert b.num_cached_tokens == 8 and kv.prefix_hit_tokens == 8
    assert kv.pool.blocks[0].ref_count == 2
    kv.free(a)
    kv.free(b)
    # b released last: its tail block 3 (partial, unhashed) jumps to the front
    assert [b.block_id for b in kv.pool.free_blocks()] == [3, 2, 4, 1, 0]
    # a new 12-token sequence with no shared prefix needs 3 blocks: 3, 2, 4 are uncached
    c = make_seq("c", [50 + i for i in range(12)])
    assert run_prefill(kv, c) == [3, 2, 4]
    assert kv.pool.num_evictions == 0
    # one more block must evict the least recently used cached block: block 1 (shared tail)
    d = make_seq("d", [70, 71])
    assert run_prefill(kv, d) == [1]
    assert kv.pool.num_evictions == 1
    # the shared prefix now matches one block only
    e = make_seq("e", shared + [3])
    assert kv.match_prefix(e).gpu_blocks == (kv.pool.blocks[0],)


def test_full_match_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS, root_hash=7)
    a = make_seq("a", list(range(8)))
    run_prefill(kv, a)
    b = make_seq("b", list(range(8)))
    assert kv.match_prefix(b).num_tokens(BS) == 4


def test_hash_collision_is_not_a_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BS, root_hash=7)
    a = make_seq("a", [1, 2, 3, 4, 5])
    run_prefill(kv, a)
    block = kv.pool.blocks[0]
    # pretend another token run had the same hash: the token comparison must reject it
    other = make_seq("b", [4, 3, 2, 1, 5])
    other.block_hashes = [block.block_hash]
    assert kv.match_prefix(other).gpu_blocks == ()


ops = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 9)), max_size=60
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_block_accounting_invariants(script):
    kv = KVCacheManager(num_blocks=12, block_size=BS, root_hash=3)
    live: dict[str, Sequence] = {}
    for n, (op, who, amount) in enumerate(script):
        rid = f"s{who}"
        if op == "add" and rid not in live:
            # few distinct token values so that prefixes are shared often
            seq = make_seq(rid, [(who * amount + i) % 3 for i in range(amount + who)])
            prefix = kv.match_prefix(seq)
            if kv.allocate(seq, seq.num_tokens - prefix.num_tokens(BS), prefix) is not None:
                seq.num_computed_tokens = seq.num_tokens
                kv.commit(seq)
                live[rid] = seq
        elif op == "grow" and rid in live:
            seq = live[rid]
            if kv.allocate(seq, amount) is not None:
                seq.token_ids += [n % 3] * amount
                seq.num_computed_tokens = seq.num_tokens
                kv.commit(seq)
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        check_invariants(kv, live)
    for seq in live.values():
        kv.free(seq)
    check_invariants(kv, {})
    assert kv.pool.num_free == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def check_invariants(kv: KVCacheManager, live: dict[str, Sequence]) -> None:
    owners: dict[int, int] = {}
    for seq in live.values():
        table = kv.block_table(seq)
        assert len(table) == kv.blocks_needed(seq.num_tokens)
        for block_id in table:
            owners[block_id] = owners.get(block_id, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_count == owners.get(block.block_id, 0)
        in_free = kv.pool.is_free(block)
        assert in_free == (block.ref_count == 0), f"block {block.block_id} free and owned"
        if block.block_hash is not None:
            assert kv.pool.cached_block(block.block_hash) is block
    assert kv.pool.num_cached == sum(b.block_hash is not None for b in kv.pool.blocks)


def test_reset_prefix_cache_drops_only_unowned_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS, root_hash=7)
    a = make_seq("a", list(range(9)))
    b = make_seq("b", [50 + i for i in range(8)])
    run_prefill(kv, a)
    run_prefill(kv, b)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2  # a's two full blocks; b still owns its own
    assert kv.match_prefix(make_seq("c", list(range(9)))).gpu_blocks == ()
    assert len(kv.match_prefix(make_seq("d", [50 + i for i in range(9)])).gpu_blocks) == 2
    check_invariants(kv, {"b": b})


# a waiting sequence is matched at every step it cannot be admitted: `BlockKeys.found_run`
# checks the run it found last block by block, and looks up only what follows it
match_ops = st.lists(st.tuples(st.sampled_from(["cache", "evict", "uncache", "collide"]), st.integers(0, 11)),
                     max_size=40)


@settings(max_examples=200, deadline=None)
@given(match_ops)
def test_a_run_found_again_is_the_run_a_fresh_lookup_finds(script):
    from tieredkv.cache.prefix import BlockKeys

    fresh = lambda: BlockKeys(BS, root_hash=7)  # noqa: E731
    matched = {start: fresh() for start in (0, 2)}  # each matches from one block on, again and again
    seq = make_seq("w", list(range(100, 100 + 12 * BS + 1)))  # 12 full blocks a hit may cover
    hashes = fresh().hit_candidates(seq)
    pool = BlockPool(6)
    parents = [7, *hashes]
    for op, i in script:
        tokens = seq.token_ids[i * BS : (i + 1) * BS]
        held = pool.cached_block(hashes[i])
        if op == "cache" and held is None:
            taken = pool.allocate(1)
            if taken is not None:
                pool.cache(taken[0], hashes[i], parents[i], tokens)
                pool.release(taken)
        elif op == "evict":
            pool.allocate(1)  # takes the least recently used unowned block
        elif op == "uncache" and held is not None:
            pool.uncache(held)
        elif op == "collide" and held is not None:  # the same hash, cached again for other tokens
            pool.uncache(held)
            taken = pool.allocate(1)
            if taken is not None:
                pool.cache(taken[0], hashes[i], parents[i], [t + 1 for t in tokens])
                pool.release(taken)
        for start, keys in matched.items():
            assert keys.found_run(seq, hashes, pool, start) == fresh().found_run(seq, hashes, pool, start)
    matched[0].forget(seq)
    assert not matched[0]._runs


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=300), st.sampled_from([1, 4, 16]), st.integers(0, 80))
def test_hashes_extended_from_any_point_chain_block_by_block(tokens, block_size, known):
    """`extend_block_hashes` makes the whole prompt bytes at once: the same keys as one block
    at a time, from whatever was hashed before (the keys of stores written earlier stay valid)."""
    from tieredkv.cache.hashing import extend_block_hashes, hash_block

    chained, parent = [], 7
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        chained.append(parent)
    assert extend_block_hashes(chained[:known], tokens, block_size, 7) == chained
