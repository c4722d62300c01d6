"""What a tensor-parallel engine cannot serve yet, refused with a ValueError naming the setting.

Rank 0 draws every row's tokens, logprobs and beam candidates as the one-rank decoder would
(`plan.Draw`), and the ranks run the forks' copy-on-write block copies, so `n`, `best_of`,
`logprobs` and beam search are served at any `tensor_parallel_size`. Still refused:
- `check_parallel_config(config)`: at construction, `remote_url` (the remote tier's store
  takes one block tensor, not one slice per rank).
"""

from __future__ import annotations

from tieredkv.config import EngineConfig

__all__ = ["check_parallel_config"]


def check_parallel_config(config: EngineConfig) -> None:
    """ValueError for an engine setting that `tensor_parallel_size` > 1 cannot serve."""
    world = config.parallel.tensor_parallel_size
    if world > 1 and config.cache.remote_url is not None:
        raise ValueError(
            f"remote_url: not supported with tensor_parallel_size > 1 yet (it is {world}); "
            "unset it or set tensor_parallel_size to 1"
        )
