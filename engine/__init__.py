"""The persistent inference engine. Imports with torch, numpy and safetensors alone.

The names below load on first use, so ``import engine.variant`` (a command line's ``--help``, a
VariantSpec read by a worker) does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"EngineConfig": "engine.engine_config", "LLMEngine": "engine.llm_engine",
            "RequestOutput": "engine.llm_engine", "ModelSource": "engine.loader", "resolve": "engine.loader",
            "SamplingParams": "engine.sampling_params", "VariantSpec": "engine.variant"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
