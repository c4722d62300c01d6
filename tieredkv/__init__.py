"""tieredkv: a tiered KV cache offloading engine for LLM inference.

    from tieredkv import LLM, SamplingParams
    llm = LLM(model="tiny-llama", num_gpu_blocks=64)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))
"""

from tieredkv.async_engine import AsyncLLM
from tieredkv.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tieredkv.config import EngineConfig
from tieredkv.engine import LLM, LLMEngine
from tieredkv.logprobs import Logprob
from tieredkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tieredkv.sampling import SamplingParams

__all__ = [
    "AsyncLLM", "LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
    "EngineConfig", "LLMEngine", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams",
]
