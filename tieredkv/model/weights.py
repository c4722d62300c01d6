"""The identity of a model's weights, for the model fingerprint: a hash of every byte of every
weight file, so that KV written for other weights is never read.

Hashing streams each file through xxh3 in large chunks (disk speed). A file's digest is
cached, in this process and in `$XDG_CACHE_HOME/tieredkv/weight_digests.json`, under its
path, device, inode, size, mtime and ctime; a file modified in the last few seconds is not
cached, since a second write within one timestamp tick could leave all of those alike.
Operations: `weights_id(model_dir)`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import xxhash

from tieredkv.user_cache import cache_dir, write_json

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CHUNK_BYTES = 16 << 20
RACY_S = 2.0  # files modified this recently are hashed every time, never cached

_digests: dict[str, tuple[tuple[int, ...], str]] = {}  # path -> (stat key, digest)


def weights_id(model_dir: str) -> str:
    """An id of the weight files in `model_dir`: each file's name and a hash of its contents."""
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(WEIGHT_SUFFIXES))
    digest = xxhash.xxh3_128()
    for name in names:
        digest.update(f"{name}:{file_digest(os.path.join(model_dir, name))};".encode())
    return digest.hexdigest()


def file_digest(path: str) -> str:
    """The xxh3-128 of a file's contents, from the cache when the file is unchanged."""
    path = os.path.realpath(path)
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cached = _digests.get(path) or _read_disk_cache().get(path)
    if cached is not None and tuple(cached[0]) == key:
        _digests[path] = (key, cached[1])
        return cached[1]
    digest = _hash_file(path)
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_S * 1e9:
        _digests[path] = (key, digest)
        _write_disk_cache(path, key, digest)
    return digest


def _hash_file(path: str) -> str:
    digest = xxhash.xxh3_128()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _disk_cache_file() -> Path:
    return cache_dir() / "weight_digests.json"


def _read_disk_cache() -> dict[str, tuple[list[int], str]]:
    try:
        doc = json.loads(_disk_cache_file().read_text())
        return {p: (entry["key"], entry["digest"]) for p, entry in doc.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _write_disk_cache(path: str, key: tuple[int, ...], digest: str) -> None:
    """Add one digest; entries of files that no longer exist are dropped."""
    entries = _read_disk_cache().items()
    doc = {p: {"key": list(k), "digest": d} for p, (k, d) in entries if os.path.exists(p)}
    doc[path] = {"key": list(key), "digest": digest}
    try:
        write_json(_disk_cache_file(), doc)
    except OSError as err:
        logger.debug("could not cache the digest of %s in %s: %s", path, _disk_cache_file(), err)
