"""Weight precision as a variant dimension: the model's dense projections quantized once, read through the ops.

A variant with ``weight_dtype`` "int8" or "fp8" keeps the checkpoint's tensors (a rollback needs them, and
the embedding lookup reads them) and adds a quantized copy of each dense projection: QKV, output,
gate/up, down and the lm_head (kernels/quant.py). MoE experts and routers keep the checkpoint's precision.
The copies are made when the variant is first prepared and cached per model object, so switching
back and forth between precisions quantizes once; a rollback to the checkpoint's precision swaps the
operation table back and frees nothing it would need again.

``quantized_ops`` wraps a ForwardOps table: each linear operation receives the quantized copy of the
weight the model passes (looked up by the parameter's identity), and the prefetch hint reads the bytes
the kernels will read. A generated linear kernel cannot take quantized weights, so such a variant is
refused.
"""
from __future__ import annotations

import threading
import weakref

import torch

from engine.errors import VariantError
from engine.forward_ops import ForwardOps
from engine.model import MLP, CausalLM
from kernels.quant import WEIGHT_DTYPES, QuantizedWeight, quantize

CHECKPOINT = "auto"  # the checkpoint's own precision
# what a dtype costs per weight, for the tuner and the reports
BYTES_PER_WEIGHT = {"int8": 1, "fp8": 1}

_cache: "weakref.WeakKeyDictionary[CausalLM, dict[str, dict[int, QuantizedWeight]]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def dense_weights(model: CausalLM) -> list[torch.Tensor]:
    """The weights a precision variant quantizes, each once (a tied lm_head is the embedding table)."""
    out = []
    for layer in model.layers:
        out += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight]
        if isinstance(layer.mlp, MLP):
            out += [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    out.append(model.lm_head_weight())
    return out


def quantized_weights(model: CausalLM, kind: str) -> dict[int, QuantizedWeight]:
    """id(parameter) -> its quantized copy; computed on first use and cached for the model's lifetime."""
    if kind not in WEIGHT_DTYPES:
        raise VariantError(f"unknown weight_dtype {kind!r}; known: {CHECKPOINT}, {', '.join(WEIGHT_DTYPES)}")
    with _lock:
        per_model = _cache.setdefault(model, {})
        if kind not in per_model:
            keep = next(model.parameters()).device.type == "cpu"  # CPU: dequantizing per prefill costs more
            try:
                per_model[kind] = {id(w): quantize(w, kind, keep_dequantized=keep) for w in dense_weights(model)}
            except (ValueError, RuntimeError) as e:
                raise VariantError(f"cannot quantize the weights to {kind}: {e}") from None
        return per_model[kind]


def quantized_bytes(model: CausalLM, kind: str) -> int:
    """Bytes of the quantized copies (what a decode step reads instead of the checkpoint's weights)."""
    return sum(q.nbytes for q in quantized_weights(model, kind).values())


def check_kernels(kind: str, impls: dict[str, str]) -> None:
    """Raises VariantError when a linear operation is generated code: it takes the checkpoint's weights only.
    ``impls``: op -> the variant's implementation."""
    generated = [op for op in ("linear", "norm_linear", "act_linear") if impls.get(op, "").startswith("generated:")]
    if generated:
        raise VariantError(f"weight_dtype {kind} cannot run generated kernels for {', '.join(generated)}: they "
                           "take the checkpoint's weights")


def quantized_ops(ops: ForwardOps, model: CausalLM, kind: str, impls: dict[str, str]) -> ForwardOps:
    """``ops`` with its linear operations fed quantized weights. ``impls``: op -> the variant's implementation."""
    check_kernels(kind, impls)
    table = quantized_weights(model, kind)

    def q(w):
        return table.get(id(w), w)

    linear, norm_linear, act_linear, prefetch = ops.linear, ops.norm_linear, ops.act_linear, ops.prefetch

    def q_linear(x, weight, bias=None):
        return linear(x, q(weight), bias)

    def q_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
        return norm_linear(x, residual, norm_weight, eps, q(weight), bias)

    def q_act_linear(x, weight):
        return act_linear(x, q(weight))

    def q_prefetch(weights, rows, site="o_proj"):
        return prefetch(tuple(w.q if isinstance(w, QuantizedWeight) else w for w in map(q, weights)), rows, site)

    # norm_moe composed from the parts keeps its router at the checkpoint's precision: the router weight is
    # not in the table, so the wrapped linear passes it through unchanged
    return ops.replace(linear=q_linear, norm_linear=q_norm_linear, act_linear=q_act_linear, prefetch=q_prefetch)
