"""The remote tier: KV blocks on a Redis server shared by engines, through redis-py's asyncio
client. `store.py` is the `BlockStore`, `connection.py` the client, its thread and the server's
health, `value_format.py` the keys and the verified values (NVMe slot headers), `index.py` what
the engine knows is stored (and its budget), `jobs.py` the two-phase job bookkeeping, `chain.py`
a local store and the remote one as one store.
`open_remote(...)` is the engine's door: errors name the config keys."""

from __future__ import annotations

from tieredkv.tiers.backend import BlockStore
from tieredkv.tiers.remote.chain import NVME_STORE_STATS, StorePair

__all__ = ["NVME_STORE_STATS", "StorePair", "open_remote", "pair_stores"]


def open_remote(remote_url: str, remote_bytes: int, block_bytes: int, fingerprint: int, block_size: int):
    """The engine's remote store (a `RemoteStore`), with errors that name the config key to
    change (`remote_url`, `remote_bytes`) as ValueError. An unreachable server is no error: the
    store starts without it, says so once, and connects when it can."""
    try:
        from tieredkv.tiers.remote.store import RemoteStore
    except ImportError as err:
        raise ValueError(
            f"remote_url: the remote tier needs the redis package ({err}); pip install 'tieredkv[remote]'"
        ) from err
    from tieredkv.tiers.remote.value_format import ValueLayout

    need = ValueLayout.for_block(block_bytes, block_size, fingerprint).value_bytes
    if remote_bytes and remote_bytes < need:
        raise ValueError(
            f"remote_bytes: {remote_bytes} bytes hold no KV block of {block_bytes} bytes (with its header); "
            f"give at least {need} bytes, e.g. '{-(-need // 2**20)}MiB', or 0 for no limit of the engine's own"
        )
    try:
        return RemoteStore(remote_url, block_bytes, fingerprint, block_size, budget_bytes=remote_bytes)
    except ValueError as err:  # URL options redis-py refuses
        raise ValueError(f"remote_url: {err}") from err


def pair_stores(local: BlockStore | None, remote: BlockStore | None) -> BlockStore | None:
    """The store below the CPU tier: the local one, the remote one beside it, or none."""
    if remote is None:
        return local
    return StorePair(local, remote)
