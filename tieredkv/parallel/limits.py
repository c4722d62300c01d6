"""What a tensor-parallel engine cannot serve yet, refused with a ValueError naming the setting.

Rank 0 samples one token per request from its own row of logits (`plan.StepPlan`), so nothing
that needs the driver to see the logits, or to fork a request, runs with
`tensor_parallel_size` > 1:
- `check_parallel_config(config)`: at construction, `remote_url` (the remote tier's store
  takes one block tensor, not one slice per rank);
- `check_parallel_request(params, world)`: at each request, `n` > 1 and `best_of` > 1 (forks, whose
  copy-on-write block copies the ranks do not run), `logprobs`, and beam search
  (`BeamSearchParams`: forks, and the driver's top-k of every beam's logits).
"""

from __future__ import annotations

from tieredkv.beam_search import BeamSearchParams
from tieredkv.config import EngineConfig
from tieredkv.sampling import SamplingParams

__all__ = ["check_parallel_config", "check_parallel_request"]


def _unsupported(setting: str, world: int, fix: str) -> ValueError:
    return ValueError(f"{setting}: not supported with tensor_parallel_size > 1 yet (it is {world}); {fix}")


def check_parallel_config(config: EngineConfig) -> None:
    """ValueError for an engine setting that `tensor_parallel_size` > 1 cannot serve."""
    world = config.parallel.tensor_parallel_size
    if world > 1 and config.cache.remote_url is not None:
        raise _unsupported("remote_url", world, "unset it or set tensor_parallel_size to 1")


def check_parallel_request(params: SamplingParams | BeamSearchParams, world: int) -> None:
    """ValueError for a request that an engine of `world` ranks cannot serve (nothing if 1)."""
    if world == 1:
        return
    fix = "or run it on an engine with tensor_parallel_size 1"
    if isinstance(params, BeamSearchParams):
        raise _unsupported("beam_search", world, f"use SamplingParams (greedy or sampled), {fix}")
    if params.num_samples > 1 and params.best_of is not None:
        raise _unsupported("best_of", world, f"leave it None (or 1), {fix}")
    if params.n > 1:
        raise _unsupported("n", world, f"use n=1 (send the prompt several times with different seeds), {fix}")
    if params.logprobs is not None:
        raise _unsupported("logprobs", world, f"leave it None, {fix}")
