"""The NVMe tier: a persistent store of KV blocks in the checksummed slots of one preallocated
file. `store.py` is the API and `opener.py` the engine's door to it; `slot_format.py` the
on-disk layout, `slot_index.py` which slot holds what, `slot_file.py` the file, `file_keeper.py`
the file over its life (lost, made anew), `slot_io.py` and `io_backends.py` / `uring_backend.py`
the I/O."""

from tieredkv.tiers.nvme.opener import open_store
from tieredkv.tiers.nvme.slot_file import STORE_FILE_NAME
from tieredkv.tiers.nvme.store import NVMeStore

__all__ = ["STORE_FILE_NAME", "NVMeStore", "open_store"]
