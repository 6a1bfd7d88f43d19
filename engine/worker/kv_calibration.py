"""The FP8 KV cache's per-layer scales, calibrated by running a fixed prompt through the variant's operations
into a cache of the checkpoint's dtype (engine/model/precision.py applies them).

A variant with ``kv_cache_dtype`` "fp8" keeps keys and values in e4m3 (one byte each: twice the blocks in the
same memory, half the bytes an attention step reads). Each layer has a key scale and a value scale: the
cache holds k / k_scale and v / v_scale; attention multiplies its scores by k_scale (folded into the softmax
scale) and its output by v_scale. The scales are powers of two, so dividing by them is exact, chosen once per
model (and weight precision) from a calibration prompt run through the variant's kernels: the smallest power
of two, at least 1, that keeps twice the largest |k| (|v|) the layer cached within e4m3's 448. A layer whose
values fit (most) has scales 1 and costs nothing extra; values beyond the range saturate at +-448. (Scales
under 1, which lift small values out of e4m3's subnormal range, were measured on SmolLM2: the gate's figures
stayed the same, max |dlogit| 3.08 against 3.19, mean KL 0.0077 against 0.0069, for an extra multiply per
layer, so they are not used.)
"""
from __future__ import annotations

import math
import threading
import weakref

import torch

from engine.errors import VariantError
from engine.model.forward_ops import ForwardOps
from engine.model.precision import CHECKPOINT
from engine.model.transformer import CausalLM
from engine.worker.model_runner import KVCache
from kernels.attention.attention import AttentionMetadata
from kernels.linear.quant import FP8_MAX

KV_MARGIN = 2.0  # headroom over the calibration prompt's largest values, for prompts that reach further
CALIBRATION_TEXT = ("The committee met on Tuesday to review the quarterly budget. Revenue rose 12% to $4.3 "
                    "million, while costs fell. def mean(xs): return sum(xs) / len(xs)  # average of a list. "
                    "Paris is the capital of France; Tokyo, of Japan. 1, 2, 3, 5, 8, 13, 21, 34, 55, 89.")
_lock = threading.Lock()
_kv_cache: "weakref.WeakKeyDictionary[CausalLM, dict[str, list[tuple[float, float]]]]" = weakref.WeakKeyDictionary()


def _pow2_scale(amax: float) -> float:
    need = amax * KV_MARGIN / FP8_MAX
    return 1.0 if need <= 1.0 else float(2.0 ** math.ceil(math.log2(need)))


@torch.inference_mode()
def kv_scales(engine, ops: ForwardOps, weight_dtype: str = CHECKPOINT) -> list[tuple[float, float]]:
    """Per layer (k_scale, v_scale) for an FP8 cache, from the calibration prompt run through ``ops`` into a cache
    of the checkpoint's dtype; cached per model and weight precision."""
    with _lock:
        per_model = _kv_cache.setdefault(engine.model, {})
        if weight_dtype in per_model:
            return per_model[weight_dtype]
    cfg, dev = engine.model_config, engine.device
    ids = engine.tokenizer.encode(CALIBRATION_TEXT) if engine.tokenizer is not None else \
        [(7 * i + 1) % cfg.vocab_size for i in range(96)]
    n = min(len(ids), engine.max_model_len)
    bs = 16
    blocks = -(-n // bs)
    kv = KVCache(cfg, blocks, bs, dev, engine.dtype)
    meta = AttentionMetadata.build(torch.arange(n, device=dev), torch.arange(blocks, dtype=torch.int32,
                                                                             device=dev)[None], [n], [0, n], dev)
    try:
        engine.model(torch.tensor(ids[:n], device=dev), torch.arange(n, device=dev), engine.runner.cos_sin,
                     kv.layers(), meta, ops)
    except Exception as e:
        raise VariantError(f"the FP8 KV cache's calibration failed: {type(e).__name__}: {e}") from None
    scales = []
    for k, v in kv.layers():
        ka = float(k.reshape(-1, k.shape[-1])[: n * k.shape[2]].abs().amax())
        va = float(v.reshape(-1, v.shape[-1])[: n * v.shape[2]].abs().amax())
        if not (math.isfinite(ka) and math.isfinite(va)):
            raise VariantError("the FP8 KV cache's calibration saw NaN or Inf keys or values")
        scales.append((_pow2_scale(ka), _pow2_scale(va)))
    with _lock:
        per_model[weight_dtype] = scales
    return scales
