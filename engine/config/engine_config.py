"""Engine settings, validated once. The engine form (knobs, KV layout, kernels, parallel layout) is a
VariantSpec, the one definition of those fields; the rest here is what loads and sizes the engine."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.config.source import ModelSource
from engine.config.variant import VariantSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    source: ModelSource
    device: str = "cpu"
    dtype: str = "float32"
    layers: int | None = None  # load only the first N decoder layers (fast benchmark tier)
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 512 * 1024**2
    # on a GPU: the fraction of its memory weights and KV cache may take; the cache gets what the loaded weights
    # leave of it (vLLM's --gpu-memory-utilization), instead of kv_cache_bytes
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    load_tokenizer: bool = True
    # Launch a greedy decode step before the previous one's tokens reach the host (see llm_engine).
    # None: on a GPU only. On a CPU the launch computes the step, so running ahead overlaps nothing and
    # only hands each token out one step late (and makes per-step times alternate long/short).
    async_decode: bool | None = None
    # The engine form to start with; None: the model's static-best on this device (engine/config/static_best.py), or
    # VariantSpec's defaults where none is recorded.
    variant: VariantSpec | None = None

    def __post_init__(self) -> None:
        if self.variant is not None and not isinstance(self.variant, VariantSpec):
            raise ConfigError(f"variant must be a VariantSpec, got {type(self.variant).__name__}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes < 1:
            raise ConfigError("kv_cache_bytes must be positive")
        if self.gpu_memory_utilization is not None:
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if not str(self.device).startswith("cuda"):
                raise ConfigError("gpu_memory_utilization applies to a GPU; on a CPU size the cache with "
                                  "kv_cache_bytes (--kv-cache-mb) or num_kv_blocks")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.layers is not None and self.layers < 1:
            raise ConfigError(f"layers must be >= 1, got {self.layers}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"bad device {self.device!r}: {e}") from None

    @property
    def run_ahead(self) -> bool:
        return self.async_decode if self.async_decode is not None else torch.device(self.device).type == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def initial_variant(self) -> VariantSpec:
        """The variant this config starts with: the given one, else the model's recorded static-best on this
        device and dtype, else VariantSpec's defaults."""
        if self.variant is not None:
            return self.variant
        from engine.config import static_best
        return static_best.lookup(self.source, self.device, self.dtype) or VariantSpec(name="default")
