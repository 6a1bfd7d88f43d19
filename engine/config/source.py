"""Where a model comes from: a GGUF file, a safetensors folder, or a config to synthesize weights for
(``engine.loader.model_source.resolve`` finds it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    """What to load: a GGUF file, a safetensors folder, or a config to synthesize weights for."""

    kind: str  # 'gguf' | 'safetensors' | 'synthetic'
    path: Path
    seed: int = 0

    @property
    def tokenizer_path(self) -> Path | None:
        """Where the tokenizer is: the GGUF file, or a model folder that has tokenizer files; else None."""
        if self.kind == "gguf":
            return self.path
        if self.kind == "safetensors" and any(
            (self.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            return self.path
        return None
