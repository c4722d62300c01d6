"""tieredkv: a tiered KV cache offloading engine for LLM inference.

    from tieredkv import LLM, SamplingParams
    llm = LLM(model="tiny-llama", num_gpu_blocks=64)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))

The public names are imported on first use, so that `import tieredkv.cli` (and `tieredkv --help`)
starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncLLM": "tieredkv.async_engine",
    "BeamSearchOutput": "tieredkv.beam_search",
    "BeamSearchParams": "tieredkv.beam_search",
    "BeamSearchSequence": "tieredkv.beam_search",
    "CompletionOutput": "tieredkv.outputs",
    "EngineConfig": "tieredkv.config",
    "LLM": "tieredkv.engine",
    "LLMEngine": "tieredkv.engine",
    "Logprob": "tieredkv.logprobs",
    "RequestMetrics": "tieredkv.outputs",
    "RequestOutput": "tieredkv.outputs",
    "SamplingParams": "tieredkv.sampling",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from tieredkv.async_engine import AsyncLLM  # noqa: F401
    from tieredkv.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: F401
    from tieredkv.config import EngineConfig  # noqa: F401
    from tieredkv.engine import LLM, LLMEngine  # noqa: F401
    from tieredkv.logprobs import Logprob  # noqa: F401
    from tieredkv.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: F401
    from tieredkv.sampling import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tieredkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
