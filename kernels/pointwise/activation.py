"""SiLU-and-multiply, the gated MLP activation."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2I) holding [gate | up]; returns silu(gate) * up, (T, I)."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
