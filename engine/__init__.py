"""kvscope's inference engine: continuous batching over a paged KV cache."""
from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import RequestOutput, TokenDelta
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta"]
__version__ = "0.1.0"
