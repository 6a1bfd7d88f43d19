"""The persistent inference engine. Imports with torch, numpy and safetensors alone.

The names below load on first use, so ``import engine.variant`` (a command line's ``--help``, a
VariantSpec read by a worker) does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"EngineConfig": "engine.config.engine_config", "LLMEngine": "engine.core.llm_engine",
            "RequestOutput": "engine.core.llm_engine", "ModelSource": "engine.config.source", "resolve": "engine.loader.model_source",
            "SamplingParams": "engine.config.sampling_params", "VariantSpec": "engine.config.variant"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
