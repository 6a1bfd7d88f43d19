"""Model configuration read from a Hugging Face ``config.json``, validated once.

One ``ModelConfig`` describes every supported family: the Llama family (SmolLM2,
Llama 3 with its RoPE scaling), Qwen2 and Qwen3 dense, and the mixture-of-experts
families Qwen3-MoE and Mixtral. Family differences are data here (QKV bias, q/k
norm, router semantics), not branches scattered over the model code.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

# model_type -> (architecture family, default attention bias, q/k norm, MoE)
_FAMILIES: dict[str, tuple[str, bool, bool, bool]] = {
    "llama": ("llama", False, False, False),
    "qwen2": ("qwen2", True, False, False),
    "qwen3": ("qwen3", False, True, False),
    "qwen3_moe": ("qwen3_moe", False, True, True),
    "mixtral": ("mixtral", False, False, True),
}
_ARCH_TO_TYPE = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is one of 'default', 'linear', 'llama3'."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ConfigError(f"unsupported rope scaling type {self.kind!r} (supported: default, linear, llama3)")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (num_experts == 0 means dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Qwen3-MoE renormalizes the top-k softmax weights only when this is set;
    # Mixtral (softmax over the top-k logits) is the same computation with it set.
    norm_topk_prob: bool = True
    # Layers that use a dense MLP although the model is MoE (Qwen3-MoE).
    dense_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in _FAMILIES:
            raise ConfigError(
                f"unknown architecture {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.is_moe:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size must be positive for a mixture-of-experts model")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    def kernel_dims(self) -> dict:
        """The shapes the forward pass hands its operations: the hidden and MLP widths, and each projection's
        (output rows N, input columns K), lm_head's included. Generated kernels are smoke-run at these."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        return {"hidden": h, "intermediate": self.intermediate_size,
                "projections": [(q + 2 * kv, h), (h, q), (2 * self.intermediate_size, h),
                                (h, self.intermediate_size), (self.vocab_size, h)]}

    def with_layers(self, layers: int | None) -> "ModelConfig":
        """The same model truncated to its first ``layers`` decoder layers (the fast benchmark tier)."""
        if layers is None or layers == self.num_hidden_layers:
            return self
        if not 0 < layers <= self.num_hidden_layers:
            raise ConfigError(f"layers must be in 1..{self.num_hidden_layers}, got {layers}")
        return dataclasses.replace(self, num_hidden_layers=layers)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type is None:
            archs = raw.get("architectures") or []
            model_type = next((_ARCH_TO_TYPE[a] for a in archs if a in _ARCH_TO_TYPE), None)
        if model_type not in _FAMILIES:
            archs = raw.get("architectures")
            raise ConfigError(
                f"unknown architecture (model_type={model_type!r}, architectures={archs!r}); "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _, default_bias, qk_norm, moe = _FAMILIES[model_type]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            head_dim = raw.get("head_dim") or hidden // heads
            rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
            rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            rope_kind = rope.get("rope_type") or rope.get("type") or "default"
            scaling = RopeScaling(
                kind=rope_kind,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            moe_fields: dict[str, Any] = {}
            if moe:
                num_experts = raw.get("num_experts") or raw.get("num_local_experts")
                moe_fields = dict(
                    num_experts=int(num_experts),
                    num_experts_per_tok=int(raw["num_experts_per_tok"]),
                    moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if model_type == "qwen3_moe" else True,
                    dense_layers=_dense_layers(raw, int(raw["num_hidden_layers"])),
                )
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", default_bias)),
                qk_norm=qk_norm,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **moe_fields,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, ArithmeticError) as e:  # e.g. rope_scaling "linear", 0 heads
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config has a field of the wrong type or value: {type(e).__name__}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(raw)

    # Sizes used by the cost model and the benchmarks.
    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _dense_layers(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    dense = set(int(i) for i in raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    for i in range(num_layers):
        if (i + 1) % step != 0:
            dense.add(i)
    return tuple(sorted(dense))
