"""Engine settings, validated once."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import ConfigError
from engine.loader import ModelSource
from engine.scheduler import SchedulerConfig
from engine.variant import VariantSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    source: ModelSource
    device: str = "cpu"
    dtype: str = "float32"
    layers: int | None = None  # load only the first N decoder layers (fast benchmark tier)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 512 * 1024**2
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    load_tokenizer: bool = True
    # Launch a greedy decode step before the previous one's tokens reach the host (see llm_engine).
    # None: on a GPU only. On a CPU the launch computes the step, so running ahead overlaps nothing and
    # only hands each token out one step late (and makes per-step times alternate long/short).
    async_decode: bool | None = None
    # The engine form to start with; its knobs override block_size, prefix caching and scheduler above.
    variant: VariantSpec | None = None

    def __post_init__(self) -> None:
        if self.variant is not None:
            v = self.variant
            object.__setattr__(self, "block_size", v.block_size)
            object.__setattr__(self, "enable_prefix_caching", v.enable_prefix_caching)
            object.__setattr__(self, "scheduler", SchedulerConfig(
                max_num_seqs=v.max_num_seqs, max_num_batched_tokens=v.max_num_batched_tokens,
                prefill_chunk_size=v.prefill_chunk_size))
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes < 1:
            raise ConfigError("kv_cache_bytes must be positive")
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
        """The variant this config starts with: the given one, or the reference kernels with these knobs."""
        if self.variant is not None:
            return self.variant
        s = self.scheduler
        return VariantSpec(name="default", max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                           prefill_chunk_size=s.prefill_chunk_size, block_size=self.block_size,
                           enable_prefix_caching=self.enable_prefix_caching)
