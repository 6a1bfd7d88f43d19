"""Rotary-embedding frequencies and the cos/sin table the forward pass reads."""
from __future__ import annotations

import math

import torch

from engine.config.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies after scaling, computed in float32 the way the Hugging Face reference does."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "llama3":
        old_len = s.original_max_position_embeddings
        low_wavelen = old_len / s.low_freq_factor
        high_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(config: ModelConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """Table of cos and sin for every position: (max_positions, 2, head_dim // 2), float32."""
    inv = rope_inv_freq(config).to(device)
    pos = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]  # (P, D/2)
    return torch.stack([freqs.cos(), freqs.sin()], dim=1)
