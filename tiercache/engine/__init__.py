"""The bundled reference engine: a small Llama-style model served with paged attention and tiercache hooks."""
from tiercache.engine.config import EngineConfig, ModelConfig
from tiercache.engine.llm import LLM, LLMEngine, RequestOutput
from tiercache.engine.sequence import SamplingParams

__all__ = ["EngineConfig", "LLM", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams"]
