"""The table of operations a forward pass calls. Variants swap the whole table between two steps."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Callable

from engine.errors import VariantError
from engine.config.variant import OP_NAMES
from kernels.pointwise.activation import silu_and_mul_ref
from kernels.attention.attention import compose_rotary_attention, paged_attention_ref, rotary_attention_ref
from kernels.attention.kv_store import store_kv_ref
from kernels.linear.linear import act_linear_ref, linear_ref, norm_linear_ref
from kernels.moe.moe import moe_ref, norm_moe_ref
from kernels.pointwise.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.attention.prefetch import prefetch_ref
from kernels.attention.rotary import norm_rotary_store_kv_ref, rotary_ref, rotary_store_kv_ref


@dataclass(frozen=True)
class ForwardOps:
    """One implementation per operation; every field has the signature of its reference in kernels/."""

    name: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    store_kv: Callable
    rotary_store_kv: Callable  # rotary then store_kv, fused or composed from the two fields above
    norm_rotary_store_kv: Callable  # per-head RMSNorm of q and k, then rotary_store_kv; fused or composed
    attention: Callable
    rotary_attention: Callable  # (norm_)rotary_store_kv, then attention; fused or composed
    moe: Callable
    linear: Callable
    norm_linear: Callable  # residual add + RMSNorm, then a projection; fused or composed
    act_linear: Callable  # SiLU-and-multiply, then a projection; fused or composed
    norm_moe: Callable  # residual add + RMSNorm, router, then moe (an MoE layer after attention); fused or composed
    prefetch: Callable  # weights a later kernel reads -> join(), called before it ("end": the step's last call;
    # "abort": a step that raised)

    def replace(self, **changes: Callable) -> "ForwardOps":
        """A copy with some operations replaced; composite operations built from parts follow the new parts."""
        table = {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **changes}
        for op, (compose, parts) in _COMPOSED.items():
            f = table[op]
            if op not in changes and isinstance(f, functools.partial) and f.func is compose:
                table[op] = functools.partial(compose, *(table[p] for p in parts))
        return ForwardOps(**table)


REFERENCE_OPS = ForwardOps(
    name="reference",
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    rotary=rotary_ref,
    silu_and_mul=silu_and_mul_ref,
    store_kv=store_kv_ref,
    rotary_store_kv=rotary_store_kv_ref,
    norm_rotary_store_kv=norm_rotary_store_kv_ref,
    attention=paged_attention_ref,
    rotary_attention=rotary_attention_ref,
    moe=moe_ref,
    linear=linear_ref,
    norm_linear=norm_linear_ref,
    act_linear=act_linear_ref,
    norm_moe=norm_moe_ref,
    prefetch=prefetch_ref,
)


def _check_names(fn: Callable) -> Callable:
    """``fn``; a partial whose keywords its function does not take (a misspelled kernel parameter) raises
    TypeError now rather than in the first forward pass."""
    if isinstance(fn, functools.partial):
        sig = inspect.signature(fn.func).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values()):
            unknown = set(fn.keywords) - set(sig)
            if unknown:
                raise TypeError(f"unknown parameters {', '.join(sorted(unknown))}")
    return fn


def _builtin(op: str, impl: str, params: dict) -> Callable:
    """Imports Triton kernels only when a variant asks for them."""
    try:
        if op in ("rms_norm", "fused_add_rms_norm"):
            from kernels.pointwise import norm_triton as m
        elif op in ("rotary", "rotary_store_kv", "norm_rotary_store_kv"):
            from kernels.attention import rotary_triton as m
        elif op == "silu_and_mul":
            from kernels.pointwise import activation_triton as m
        elif op == "store_kv":
            from kernels.attention import kv_store_triton as m
        elif op == "norm_moe":
            from kernels.moe.moe_triton import make_norm_moe

            return make_norm_moe(**params)
        elif op == "moe":
            from kernels.moe.moe_triton import make_moe

            return make_moe(**params)
        elif op == "prefetch":
            from kernels.attention.prefetch_triton import make_prefetch

            return make_prefetch(**params)
        elif op in ("linear", "norm_linear", "act_linear"):
            from kernels.linear import linear_triton as m
        elif op == "attention":
            from kernels.attention.attention_triton import make_attention

            return make_attention("paged" if impl == "triton_paged" else "split_kv", **params)
        elif op == "rotary_attention":
            from kernels.attention.attention_triton import make_rotary_attention

            return make_rotary_attention(**params)
        else:
            raise KeyError(op)
    except ImportError as e:
        raise VariantError(f"{op}={impl} needs Triton, which is not importable here: {e}") from None
    fn = getattr(m, f"{op}_triton")
    return functools.partial(fn, **params) if params else fn


def _rotary_then_store(rotary, store_kv, q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping):
    """``rotary_store_kv`` composed from a table's own rotary and store_kv (generated ones included)."""
    q, k = rotary(q, k, positions, cos_sin)
    store_kv(k, v.contiguous(), k_cache, v_cache, slot_mapping)
    return q


def _norm_then_rotary_store(rms_norm, rotary_store_kv, q, k, v, q_weight, k_weight, eps, positions, cos_sin,
                             k_cache, v_cache, slot_mapping):
    return rotary_store_kv(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), v, positions, cos_sin, k_cache,
                           v_cache, slot_mapping)


def _norm_then_linear(fused_add_rms_norm, linear, x, residual, norm_weight, eps, weight, bias=None):
    h, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), summed


def _act_then_linear(silu_and_mul, linear, x, weight):
    return linear(silu_and_mul(x), weight)


def _norm_then_moe(fused_add_rms_norm, linear, moe, x, residual, norm_weight, eps, gate_weight, w13, w2, top_k,
                   renormalize):
    h, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return moe(h, linear(h, gate_weight), w13, w2, top_k, renormalize), summed


# composite operations whose "reference" is the table's own parts, called one after the other
_COMPOSED = {
    "rotary_store_kv": (_rotary_then_store, ("rotary", "store_kv")),
    "norm_rotary_store_kv": (_norm_then_rotary_store, ("rms_norm", "rotary_store_kv")),
    "rotary_attention": (compose_rotary_attention, ("rotary_store_kv", "norm_rotary_store_kv", "attention")),
    "norm_linear": (_norm_then_linear, ("fused_add_rms_norm", "linear")),
    "act_linear": (_act_then_linear, ("silu_and_mul", "linear")),
    "norm_moe": (_norm_then_moe, ("fused_add_rms_norm", "linear", "moe")),
}


def build_ops(spec, dims: dict | None = None, device: str = "cpu") -> ForwardOps:
    """The ForwardOps table a VariantSpec describes. Generated kernels are checked and smoke-run first, on
    ``device`` at the model's served shapes (``dims``: engine.generated.source, kernels/generated/launch.py).

    Raises VariantError (nothing is changed) when any operation cannot be built.
    """
    from engine.generated.source import prepare_generated

    sources = dict(spec.generated_source)
    table = {}
    for op in OP_NAMES:  # composite operations come after their parts
        impl, params = spec.impl(op), spec.params(op)
        if op in _COMPOSED and impl == "reference":
            compose, parts = _COMPOSED[op]
            table[op] = functools.partial(compose, *(table[p] for p in parts))
        elif impl == "reference":
            table[op] = getattr(REFERENCE_OPS, op)
        elif impl.startswith("generated:"):
            module, _, function = impl.split(":", 1)[1].rpartition(".")
            if not module:
                raise VariantError(f"{op}={impl}: expected generated:<module>.<function>")
            table[op] = prepare_generated(op, module, function, sources[module], params, dims, device)
        else:
            try:
                table[op] = _check_names(_builtin(op, impl, params))
            except (TypeError, ValueError) as e:  # a kernel's parameters: unknown, out of range, or not combinable
                raise VariantError(f"{op}={impl}: bad kernel_params: {e}") from None
    return ForwardOps(name=spec.variant_id, **table)
