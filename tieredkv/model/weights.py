"""The identity of a model's weights, for the model fingerprint."""

from __future__ import annotations

import os

import xxhash


def weights_id(model_dir: str, sample_bytes: int = 1 << 20) -> str:
    """An id of the weight files in a model directory: each file's name and size, and a hash of
    its first and last `sample_bytes` (cheap, and changes whenever the weights do in practice)."""
    digest = xxhash.xxh3_64()
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            continue
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        digest.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(sample_bytes))
            f.seek(max(0, size - sample_bytes))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()
