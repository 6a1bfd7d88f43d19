"""Assembling checkpoint tensors (Hugging Face names) into the engine's fused parameters.

The model is built on the meta device; each parameter is allocated once on the
target device and filled piece by piece from the checkpoint (q/k/v into qkv_proj,
gate/up into gate_up_proj, per-expert matrices into stacked expert tensors), so
no second copy of the weights is ever held.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch

from engine.config.model_config import ModelConfig
from engine.errors import WeightsError
from engine.model.transformer import CausalLM


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter and the slice of it the tensor fills."""

    param: str
    piece: str  # names the slice; every piece of a parameter must be filled exactly once
    index: tuple  # index into the parameter that receives the tensor


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def hf_target(cfg: ModelConfig, name: str) -> Target | None:
    """Maps a Hugging Face checkpoint name to its place in the engine; None for layers not loaded."""
    if name == "model.embed_tokens.weight":
        return Target("embed_tokens.weight", "all", ())
    if name == "model.norm.weight":
        return Target("norm", "all", ())
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else Target("lm_head", "all", ())
    m = _LAYER.match(name)
    if m is None:
        if name.endswith("rotary_emb.inv_freq"):
            return None
        raise WeightsError(f"unexpected tensor {name!r} in checkpoint")
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= cfg.num_hidden_layers:
        return None
    p = f"layers.{layer}."
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    simple = {
        "input_layernorm.weight": "input_layernorm",
        "post_attention_layernorm.weight": "post_attention_layernorm",
        "self_attn.o_proj.weight": "self_attn.o_proj.weight",
        "self_attn.q_norm.weight": "self_attn.q_norm",
        "self_attn.k_norm.weight": "self_attn.k_norm",
        "mlp.down_proj.weight": "mlp.down_proj.weight",
        "mlp.gate.weight": "mlp.gate.weight",
        "block_sparse_moe.gate.weight": "mlp.gate.weight",
        "mlp.experts.down_proj": "mlp.w2",
        "mlp.experts.gate_up_proj": "mlp.w13",
    }
    if rest in simple:
        return Target(p + simple[rest], "all", ())
    m2 = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", rest)
    if m2:
        which, kind = m2.groups()
        return Target(f"{p}self_attn.qkv_proj.{kind}", which, (qkv[which],))
    inter = cfg.intermediate_size
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        half = slice(0, inter) if "gate" in rest else slice(inter, 2 * inter)
        return Target(p + "mlp.gate_up_proj.weight", rest.split(".")[1], (half,))
    m3 = _EXPERT.match(rest)
    if m3:
        e, proj = int(m3.group(2)), m3.group(3)
        mi = cfg.moe_intermediate_size
        if proj in ("gate_proj", "w1"):
            return Target(p + "mlp.w13", f"{e}.gate", (e, slice(0, mi)))
        if proj in ("up_proj", "w3"):
            return Target(p + "mlp.w13", f"{e}.up", (e, slice(mi, 2 * mi)))
        if proj in ("down_proj", "w2"):
            return Target(p + "mlp.w2", f"{e}.down", (e,))
    raise WeightsError(f"unexpected tensor {name!r} in checkpoint")


def _pieces(cfg: ModelConfig, param: str) -> set[str]:
    """Every piece a parameter needs before it is complete."""
    if param.endswith("qkv_proj.weight") or param.endswith("qkv_proj.bias"):
        return {"q", "k", "v"}
    if param.endswith("gate_up_proj.weight"):
        return {"gate_proj", "up_proj"}
    return {"all"}


def _expert_pieces(cfg: ModelConfig, param: str) -> set[str]:
    kind = ("gate", "up") if param.endswith("w13") else ("down",)
    return {f"{e}.{k}" for e in range(cfg.num_experts) for k in kind}


def assemble(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype
) -> CausalLM:
    """Builds the model from (Hugging Face name, tensor) pairs; raises WeightsError naming what is missing."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    params: dict[str, torch.Tensor] = {}
    filled: dict[str, set[str]] = {}
    for name, tensor in tensors:
        target = hf_target(cfg, name)
        if target is None:
            continue
        if target.param not in shapes:
            raise WeightsError(f"checkpoint tensor {name!r} has no place in a {cfg.model_type} model with this config")
        if target.param not in params:
            params[target.param] = torch.empty(shapes[target.param], device=device, dtype=dtype)
            filled[target.param] = set()
        try:
            dest = params[target.param][target.index] if target.index else params[target.param]
        except IndexError:  # e.g. expert 130 in a model the config gives 128 experts
            raise WeightsError(f"checkpoint tensor {name!r} is outside {target.param} "
                               f"{tuple(shapes[target.param])} for this config") from None
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} for this config"
            )
        dest.copy_(tensor)
        filled[target.param].add(target.piece)
    missing = []
    for pname in shapes:
        need = _expert_pieces(cfg, pname) if pname.endswith(("mlp.w13", "mlp.w2")) else _pieces(cfg, pname)
        have = filled.get(pname, set())
        if "all" not in have and not need <= have:
            missing.append(pname if have == set() else f"{pname} (missing {sorted(need - have)[:4]})")
    if missing:
        raise WeightsError(f"checkpoint is missing {len(missing)} tensors, e.g. {', '.join(missing[:5])}")
    model.load_state_dict(params, assign=True, strict=True)
    return model.eval().requires_grad_(False)


def synthetic_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int) -> CausalLM:
    """Random weights reproducible from the seed, generated directly on the target device.

    Matrices are N(0, 0.02^2) like Hugging Face's initializer; norm weights are near 1.
    """
    with torch.device("meta"):
        model = CausalLM(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = {}
    for name, p in model.named_parameters():
        t = torch.empty(p.shape, device=device, dtype=torch.float32)
        if p.dim() == 1 and not name.endswith("bias"):
            t.normal_(1.0, 0.05, generator=gen)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        params[name] = t.to(dtype)
    model.load_state_dict(params, assign=True, strict=True)
    return model.eval().requires_grad_(False)
