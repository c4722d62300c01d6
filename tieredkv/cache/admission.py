"""The CPU tier's replacement policy (`cache.cpu_policy`): which demoted blocks it keeps once full.

The rules are pure and shared with the NVMe store, so they live at the bottom of the package
(`tieredkv/replacement.py`, whose docstring describes them). The CPU tier (`cache/offload.py`)
offers each block the GPU evicts (`offered`), records each admitted request with the number of
its blocks found on the GPU (`record(hashes, num_gpu_hits)`), and keeps a demotion in place of
its LRU victim when the policy `admits` it; its spill to disk asks `count` and `selective`.
"""

from tieredkv.replacement import (
    HORIZON_PER_BLOCK,
    PERIOD_PER_BLOCK,
    AdaptiveAdmission,
    Admission,
    AdmitAll,
    FrequencyAdmission,
    GhostTier,
    ReplacementPolicy,
    make_admission,
)

CPUPolicy = ReplacementPolicy

__all__ = [
    "HORIZON_PER_BLOCK", "PERIOD_PER_BLOCK", "AdaptiveAdmission", "Admission", "AdmitAll", "CPUPolicy",
    "FrequencyAdmission", "GhostTier", "make_admission",
]
