"""Where tieredkv keeps what it measured or computed once per machine: `$XDG_CACHE_HOME/tieredkv`
(default `~/.cache/tieredkv`). Operations: `cache_dir()`, `write_json(path, doc)`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """The folder of tieredkv's caches (not created here)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tieredkv"


def write_json(path: Path, doc: Any) -> None:
    """Replace `path` with `doc` atomically (a reader sees the old file or the new one); raises
    OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
