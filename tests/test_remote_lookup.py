"""A prefix on a distant remote tier is looked up in one round trip, not one per block: the
store asks the server about all the blocks it does not know in one pipeline of EXISTS (each
server its own, at once), remembers the answers, and the engine's prefix match asks about
windows of blocks. Real redis-servers behind a relay that delays each request 20 ms."""

from __future__ import annotations

import importlib
import random
import time
from pathlib import Path

from tests.remote_link import SlowLink
from tests.remote_worker import GREEDY, LOAD_WINS, NEW_TOKENS
from tests.test_remote_store import BLOCK_BYTES, BLOCK_SIZE, FINGERPRINT, block, open_store, ref, write_all
from tieredkv import LLM, SamplingParams
from tieredkv.cache.lower_tier import FIRST_LOOKUP_BLOCKS
from tieredkv.sequence import Sequence
from tieredkv.tiers.remote import StorePair, open_remote
from tieredkv.tiers.remote.value_format import block_key

ROOT = Path(__file__).resolve().parents[1]
LATENCY_S = 0.02  # each request through the relay; the old lookup paid it once per block
FAST = 1e9  # the relay's reply bandwidth: only latency counts here


def hashes(ids) -> list[int]:
    return [ref(i).block_hash for i in ids]


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def test_a_run_of_blocks_costs_one_round_trip_and_answers_are_remembered(redis_server):
    with open_store(redis_server.url) as writer:
        assert all(write_all(writer, range(64)).values())
    with SlowLink(redis_server.port, FAST, LATENCY_S) as link, open_store(link.url) as store:
        assert not store.contains(ref(500).block_hash)  # the connection is warm
        run, elapsed = timed(store.contains_run, hashes([*range(64), 64, 65]))
        assert run == 64
        assert elapsed < 5 * LATENCY_S  # one pipeline, a few 4 KiB pieces (one EXISTS a block: >= 1.28 s)
        # known now, stored and absent alike: no round trip
        run, elapsed = timed(store.contains_run, hashes([*range(10), 64, *range(10, 20)]))
        assert run == 10 and elapsed < LATENCY_S
        # a block known absent ends the run; nothing past it is asked about
        run, elapsed = timed(store.contains_run, hashes([0, 1, 64, 600, 601]))
        assert run == 2 and elapsed < LATENCY_S
        assert not store.contains(ref(600).block_hash) and store.stats()["remote_errors"] == 0
    assert store.contains_run(hashes(range(3))) == 0  # closed: nothing is found


def test_store_pair_runs_through_blocks_held_by_either_store(redis_server, tmp_path):
    from tieredkv.tiers.nvme import NVMeStore

    nvme = NVMeStore(tmp_path / "nvme", 1 << 20, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE, backend="sync")
    with open_store(redis_server.url) as other:  # another engine stored blocks 0, 1, 3, 4 on the server
        write_all(other, [0, 1, 3, 4])
    jobs = [nvme.submit_write(ref(i), block(i)) for i in (2, 5)]
    assert all(nvme.wait(jobs, timeout=30).values())
    with StorePair(nvme, open_store(redis_server.url)) as pair:
        assert nvme.contains_run(hashes(range(8))) == 0 and nvme.contains_run(hashes([2, 5, 0])) == 2
        assert pair.contains_run(hashes(range(8))) == 6
        assert pair.contains_run(hashes([0, 1, 7, 2])) == 2


def test_sharded_servers_are_asked_at_once_and_the_run_ends_at_the_first_block_lost(two_servers):
    with SlowLink(two_servers[0].port, FAST, LATENCY_S) as a, SlowLink(two_servers[1].port, FAST, LATENCY_S) as b:
        urls = (a.url, b.url)  # blocks are placed by server address: every engine here uses the relays'
        with open_remote(urls, 0, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE) as writer:
            assert all(writer.wait([writer.submit_write(ref(i), block(i)) for i in range(64)], timeout=30).values())
            lost = next(i for i in range(20, 64) if writer.server_of(ref(i).block_hash) == 1)
        two_servers[1].client().delete(block_key(FINGERPRINT, ref(lost).block_hash))
        with open_remote(urls, 0, BLOCK_BYTES, FINGERPRINT, BLOCK_SIZE) as shards:
            assert not any(shards.contains(ref(500 + i).block_hash) for i in range(8))  # both connections warm
            run, elapsed = timed(shards.contains_run, hashes(range(64)))
            assert run == lost
            assert elapsed < 5 * LATENCY_S  # both servers at once, one pipeline each (one EXISTS a block: >= 1.28 s)
            assert shards.contains_run(hashes(range(lost))) == lost


def test_a_distant_prefix_is_matched_in_one_round_trip_and_tokens_are_exact(redis_server, monkeypatch,
                                                                            reference_outputs):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_remote_ttft")
    prompt = [random.Random(7).randrange(3, 512) for _ in range(FIRST_LOOKUP_BLOCKS * 4 + 1)]  # 64 blocks + 1
    engine = dict(model="tiny-llama", block_size=4, num_gpu_blocks=96, cpu_cache_bytes=96 * 2048, cpu_policy="lru")
    with LLM(**engine, remote_url=redis_server.url) as first:
        first.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        assert bench.write_prompt_blocks(first, prompt) == 64
    with SlowLink(redis_server.port, FAST, LATENCY_S) as link:
        with LLM(**engine, remote_url=link.url, scheduler={"cost_model": LOAD_WINS}) as llm:
            assert not llm.remote.contains(1)  # the connection is warm
            seq = Sequence("probe", prompt, GREEDY)
            match, elapsed = timed(llm.kv.match_prefix, seq)
            assert match.num_lower == 64 and not match.gpu_blocks and not match.cpu_blocks
            assert elapsed < 5 * LATENCY_S  # one block at a time took 64 round trips (1.28 s)
            tokens = [o.token_ids for o in llm.generate([prompt], GREEDY, use_tqdm=False)]
            stats = llm.stats()
    assert tokens == reference_outputs("tiny-llama", [prompt], NEW_TOKENS)
    assert stats["remote_hit_blocks"] > 0 and stats["remote_errors"] == 0
