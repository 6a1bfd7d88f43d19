"""Weight precision as a variant dimension: the model's dense projections quantized once, read through the ops.

A variant with ``weight_dtype`` "int8" or "fp8" keeps the checkpoint's tensors (a rollback needs them, and
the embedding lookup reads them) and adds a quantized copy of each dense projection: QKV, output,
gate/up, down and the lm_head (kernels/linear/quant.py). MoE experts and routers keep the checkpoint's precision.
The copies are made when the variant is first prepared and cached with the model, keyed by the precision and a
hash of the weights' contents (``weights_hash``), so switching back and forth between precisions quantizes once,
and weights changed in place (a checkpoint loaded into the same model) are quantized again rather than served
stale; a rollback to the checkpoint's precision swaps the operation table back and frees nothing it would need
again.

``quantized_ops`` wraps a ForwardOps table: each linear operation receives the quantized copy of the
weight the model passes (looked up by the parameter's identity), and the prefetch hint reads the bytes
the kernels will read. A generated linear kernel cannot take quantized weights, so such a variant is
refused. FP8 weights on a GPU with FP8 tensor cores take the W8A8 GEMM from ``W8A8_MIN_ROWS`` rows (prefill and
chunked-prefill steps): the activations' e4m3 codes made by the norm or activation kernel that computes them
(kernels/linear/w8a8.py); the same numbers as the FP8 GEMM's own per-row quantization, without the bf16 round trip.
"""
from __future__ import annotations

import hashlib
import threading
import weakref

import torch

from engine.errors import VariantError
from engine.model.forward_ops import ForwardOps
from engine.model.transformer import MLP, CausalLM
from kernels.linear.quant import WEIGHT_DTYPES, QuantizedWeight, quantize
from kernels.linear.w8a8 import MAX_NORM_D

CHECKPOINT = "auto"  # the checkpoint's own precision

# model -> (kind, weights hash) -> id(parameter) -> its quantized copy
_cache: "weakref.WeakKeyDictionary[CausalLM, dict[tuple[str, str], dict[int, QuantizedWeight]]]" = \
    weakref.WeakKeyDictionary()
# model -> id(parameter) -> ((storage, in-place version, shape, dtype), the content's digest)
_digests: "weakref.WeakKeyDictionary[CausalLM, dict[int, tuple[tuple, str]]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_CHUNK = 1 << 24  # elements per pass of the digest (bounded temporary memory on a GPU)


def dense_weights(model: CausalLM) -> list[torch.Tensor]:
    """The weights a precision variant quantizes, each once (a tied lm_head is the embedding table)."""
    out = []
    for layer in model.layers:
        out += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight]
        if isinstance(layer.mlp, MLP):
            out += [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    out.append(model.lm_head_weight())
    return out


def _content_digest(w: torch.Tensor) -> str:
    """The tensor's dtype, shape and contents: on the CPU a SHA-256 of its bytes; on a GPU (copying the weights to
    the host would cost more than quantizing them) two position-weighted sums of its bit patterns, on the device in
    chunks, which any change of a value changes but for a collision of both sums modulo 2^64."""
    w = w.detach().contiguous()
    head = f"{w.dtype}:{tuple(w.shape)}:"
    if w.device.type == "cpu":
        return head + hashlib.sha256(w.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return head + _bit_sums(w)


def _bit_sums(w: torch.Tensor) -> str:
    """The GPU digest of a contiguous tensor, on its own device (also runs on the CPU, for the tests)."""
    bits_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
    flat = w.reshape(-1).view(bits_dtype)
    s1 = s2 = 0
    with torch.no_grad():
        for start in range(0, flat.numel(), _CHUNK):
            b = flat[start:start + _CHUNK].to(torch.int64)
            pos = torch.arange(start, start + b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
            s1 += int(b.sum())
            s2 += int((b * pos).sum())
    return f"{s1}:{s2}"


def weights_hash(model: CausalLM) -> str:
    """A hash of the dense weights' contents (``dense_weights``). Each weight's digest is kept until its storage
    or its in-place version counter changes, so a repeated call reads no weights."""
    h = hashlib.sha256()
    memo = _digests.setdefault(model, {})
    for w in dense_weights(model):
        stamp = (w.data_ptr(), w._version, tuple(w.shape), w.dtype)
        got = memo.get(id(w))
        if got is None or got[0] != stamp:
            got = memo[id(w)] = (stamp, _content_digest(w))
        h.update(got[1].encode())
    return h.hexdigest()[:16]


def quantized_weights(model: CausalLM, kind: str) -> dict[int, QuantizedWeight]:
    """id(parameter) -> its quantized copy; computed on first use and cached with the model under the weights'
    hash (weights changed since: quantized again, the stale copies of that precision dropped)."""
    if kind not in WEIGHT_DTYPES:
        raise VariantError(f"unknown weight_dtype {kind!r}; known: {CHECKPOINT}, {', '.join(WEIGHT_DTYPES)}")
    with _lock:
        per_model = _cache.setdefault(model, {})
        key = (kind, weights_hash(model))
        if key not in per_model:
            for stale in [k for k in per_model if k[0] == kind]:
                del per_model[stale]
            keep = next(model.parameters()).device.type == "cpu"  # CPU: dequantizing per prefill costs more
            try:
                per_model[key] = {id(w): quantize(w, kind, keep_dequantized=keep) for w in dense_weights(model)}
            except (ValueError, RuntimeError) as e:
                raise VariantError(f"cannot quantize the weights to {kind}: {e}") from None
        return per_model[key]


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


def quantized_ops(ops: ForwardOps, model: CausalLM, kind: str, impls: dict[str, str], fast_accum: bool = False
                  ) -> ForwardOps:
    """``ops`` with its linear operations fed quantized weights. ``impls``: op -> the variant's implementation;
    ``fast_accum``: FP8's W8A8 GEMM keeps its sums in the tensor cores' accumulator (``fp8_accumulation`` fast)."""
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

    if kind == "fp8":
        q_linear, q_norm_linear, q_act_linear = _w8a8(q_linear, q_norm_linear, q_act_linear, q, fast_accum)
    # norm_moe composed from the parts keeps its router at the checkpoint's precision: the router weight is
    # not in the table, so the wrapped linear passes it through unchanged
    return ops.replace(linear=q_linear, norm_linear=q_norm_linear, act_linear=q_act_linear, prefetch=q_prefetch)


W8A8_MIN_ROWS = 65  # rows from which FP8 projections take the W8A8 GEMM (to 64: the decode kernels' own forms)


def w8a8_device(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows can take the W8A8 path: FP8 tensor cores and Triton (kernels/linear/w8a8_triton.py)."""
    from kernels.linear.quant import fp8_gemm_supported

    return fp8_gemm_supported(x.device)


def _w8a8(linear, norm_linear, act_linear, q, fast_accum: bool = False):
    """The three linear operations with FP8 weights of ``W8A8_MIN_ROWS`` rows or more through the W8A8 GEMM, the
    activations' codes made by the kernel that computes them (kernels/linear/w8a8.py), its sums kept in the tensor
    cores' accumulator with ``fast_accum``; fewer rows, or a device without FP8 tensor cores, keep the operations
    given."""
    def takes(x, weight) -> bool:
        from kernels.linear.w8a8 import supports

        return x.shape[0] >= W8A8_MIN_ROWS and supports(x, weight) and w8a8_device(x)

    def w_linear(x, weight, bias=None):
        qw = q(weight)
        if takes(x, qw):
            from kernels.linear.w8a8_triton import linear_w8a8

            return linear_w8a8(x, qw, bias, fast_accum)
        return linear(x, weight, bias)

    def w_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
        qw = q(weight)
        if takes(x, qw) and x.shape[1] <= MAX_NORM_D:
            from kernels.linear.w8a8_triton import norm_linear_w8a8

            return norm_linear_w8a8(x, residual, norm_weight, eps, qw, bias, fast_accum)
        return norm_linear(x, residual, norm_weight, eps, weight, bias)

    def w_act_linear(x, weight):
        qw = q(weight)
        if takes(x, qw):
            from kernels.linear.w8a8_triton import act_linear_w8a8

            return act_linear_w8a8(x, qw, fast_accum)
        return act_linear(x, weight)

    return w_linear, w_norm_linear, w_act_linear


# ---- the KV cache's precision (its per-layer scales are calibrated in engine/worker/kv_calibration.py) ----
def kv_cache_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for a variant's ``kv_cache_dtype`` and the checkpoint's dtype."""
    if kind == CHECKPOINT:
        return dtype
    if kind == "fp8":
        return torch.float8_e4m3fn
    raise VariantError(f"unknown kv_cache_dtype {kind!r}; known: {CHECKPOINT}, fp8")


def fp8_kv_ops(ops: ForwardOps, scales: list[tuple[float, float]]) -> ForwardOps:
    """``ops`` whose attention block keeps its keys and values scaled for an FP8 cache (the layer is read from
    the cache view's place in the pool: layer i's keys start at 2 i layer sizes)."""
    inner = ops.rotary_attention
    scaled_norms: dict[int, torch.Tensor] = {}

    def rotary_attention(q, k, v, q_weight, k_weight, eps, positions, cos_sin, k_cache, v_cache, meta, scale):
        ks, vs = scales[k_cache.storage_offset() // (2 * k_cache.numel())]
        if ks != 1.0:
            if k_weight is not None:  # keys normed per head (Qwen3): the norm's weight carries the scale
                if id(k_weight) not in scaled_norms:
                    scaled_norms[id(k_weight)] = k_weight / ks
                k_weight = scaled_norms[id(k_weight)]
            else:
                k = k / ks
            scale = scale * ks
        if vs != 1.0:
            v = v / vs
        out = inner(q, k, v, q_weight, k_weight, eps, positions, cos_sin, k_cache, v_cache, meta, scale)
        return out if vs == 1.0 else out * vs

    return ops.replace(rotary_attention=rotary_attention)
