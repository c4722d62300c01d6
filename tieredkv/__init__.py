"""tieredkv: a tiered KV cache offloading engine for LLM inference.

    from tieredkv import LLM, SamplingParams
    llm = LLM(model="tiny-llama", num_gpu_blocks=64)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0.0))
"""

from tieredkv.async_engine import AsyncLLM
from tieredkv.config import EngineConfig
from tieredkv.engine import LLM, LLMEngine
from tieredkv.outputs import RequestMetrics, RequestOutput
from tieredkv.sampling import SamplingParams

__all__ = ["AsyncLLM", "LLM", "EngineConfig", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]
