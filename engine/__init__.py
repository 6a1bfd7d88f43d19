"""The persistent inference engine. Imports with torch, numpy and safetensors alone."""
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.loader import ModelSource, resolve
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig

__all__ = ["EngineConfig", "LLMEngine", "ModelSource", "RequestOutput", "SamplingParams", "SchedulerConfig", "resolve"]
