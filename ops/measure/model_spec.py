"""ModelSpec: the served model's shape and identity."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.config.model_config import ModelConfig
from engine.loader.model_source import load_config
from engine.config.source import ModelSource


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    experts_per_token: int
    dtype: str
    param_bytes: int  # weights read per forward pass (active experts only for MoE)
    kv_bytes_per_token: int
    weights_hash: str  # changes when the weight files or the config change
    source: str

    def to_json(self) -> dict:
        return asdict(self)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def param_count(cfg: ModelConfig, active_only: bool = True) -> int:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = h * (q + 2 * kv) + q * h
    per_layer = []
    for layer in range(cfg.num_hidden_layers):
        if cfg.layer_is_moe(layer):
            experts = cfg.num_experts_per_tok if active_only else cfg.num_experts
            mlp = experts * 3 * h * cfg.moe_intermediate_size + h * cfg.num_experts
        else:
            mlp = 3 * h * i
        per_layer.append(attn + mlp + 2 * h)
    head = 0 if cfg.tie_word_embeddings else v * h
    return sum(per_layer) + v * h + head + h


def weights_hash(source: ModelSource) -> str:
    """sha256 over the weight files and config (for synthetic weights: the config and the seed)."""
    h = hashlib.sha256()
    path = Path(source.path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir()
                                                 if p.suffix in (".safetensors", ".json", ".gguf"))
    if source.kind == "synthetic":
        h.update(f"synthetic seed={source.seed}".encode())
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def model_spec(source: ModelSource, dtype: str = "float32", layers: int | None = None) -> ModelSpec:
    cfg = load_config(source).with_layers(layers)
    elem = _DTYPE_BYTES[dtype]
    return ModelSpec(
        architecture=cfg.model_type, layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        vocab=cfg.vocab_size, experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok, dtype=dtype,
        param_bytes=param_count(cfg) * elem, kv_bytes_per_token=cfg.kv_bytes_per_token(elem),
        weights_hash=weights_hash(source), source=str(source.path),
    )
