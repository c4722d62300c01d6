"""The remote tier: KV blocks on a Redis server shared by engines, through redis-py's asyncio
client. `store.py` is the `BlockStore`, `connection.py` the client, its thread and the server's
health, `value_format.py` the keys and the verified values (NVMe slot headers), `index.py` what
the engine knows is stored (and its budget), `ledger.py` that index with the counters, kept for
the store's threads, `jobs.py` the two-phase job bookkeeping, `chain.py`
a local store and the remote one as one store, `shards.py` several servers as one store,
`reader.py` the reads straight into blocks.
`open_remote(...)` is the engine's door: errors name the config keys."""

from __future__ import annotations

from tieredkv.tiers.remote.chain import NVME_STORE_STATS, StorePair

__all__ = ["NVME_STORE_STATS", "StorePair", "open_remote"]


def open_remote(remote_url: str | tuple[str, ...], remote_bytes: int, block_bytes: int, fingerprint: int,
                block_size: int, key_suffix: str = ""):
    """The engine's remote store: a `RemoteStore` on one server, `RemoteShards` over several
    (`remote_bytes` shared evenly among them), with errors that name the config key to change
    (`remote_url`, `remote_bytes`) as ValueError. An unreachable server is no error: the store
    starts without it, says so once, and connects when it can. `key_suffix`: see `RemoteStore`."""
    try:
        from tieredkv.tiers.remote.shards import RemoteShards
        from tieredkv.tiers.remote.store import RemoteStore
    except ImportError as err:
        raise ValueError(
            f"remote_url: the remote tier needs the redis package ({err}); pip install 'tieredkv[remote]'"
        ) from err
    from tieredkv.tiers.remote.value_format import ValueLayout

    urls = [remote_url] if isinstance(remote_url, str) else list(remote_url)
    need = len(urls) * ValueLayout.for_block(block_bytes, block_size, fingerprint).value_bytes
    if remote_bytes and remote_bytes < need:
        servers = f" on each of {len(urls)} servers" if len(urls) > 1 else ""
        raise ValueError(
            f"remote_bytes: {remote_bytes} bytes hold no KV block of {block_bytes} bytes (with its header){servers}; "
            f"give at least {need} bytes, e.g. '{-(-need // 2**20)}MiB', or 0 for no limit of the engine's own"
        )
    stores: list[RemoteStore] = []
    try:
        budget = remote_bytes // len(urls)
        for url in urls:
            stores.append(RemoteStore(url, block_bytes, fingerprint, block_size, budget_bytes=budget,
                                      key_suffix=key_suffix))
        return stores[0] if len(stores) == 1 else RemoteShards(stores)
    except ValueError as err:  # URL options redis-py refuses, a server listed twice
        for store in stores:
            store.close()
        raise ValueError(f"remote_url: {err}") from err
