"""The table of operations a forward pass calls. Variants swap the whole table between two steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref
from kernels.kv_store import store_kv_ref
from kernels.moe import moe_ref
from kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotary_ref


@dataclass(frozen=True)
class ForwardOps:
    """One implementation per operation; every field has the signature of its reference in kernels/."""

    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    store_kv: Callable
    attention: Callable
    moe: Callable


REFERENCE_OPS = ForwardOps(
    name="reference",
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    rotary=rotary_ref,
    silu_and_mul=silu_and_mul_ref,
    store_kv=store_kv_ref,
    attention=paged_attention_ref,
    moe=moe_ref,
)
