"""4. The Llama-3.1-8B-shaped model (random bf16 weights): batch-1 decode as a fraction of the roofline
(weight + KV bytes per token over the copy bandwidth), form by form (presets of engine/config/presets.py), against
transformers with a static cache on the same weights."""
from __future__ import annotations

import dataclasses
import time
import traceback

import torch

from bench.gpu.harness import GRAPH_SIZES, Llama8B, decode_tps, row, section, timed
from engine.config.presets import preset_variant


# the 8B decode forms after the reference: (label, preset, CUDA graphs), each run ahead of the host; in the order
# they were found, the last five the best (--decode-quick)
FORMS = (
    ("triton, eager, ahead", "triton-paged", False),
    ("triton + graphs, fused rotary+store_kv, ahead (previous best)", "triton-paged", True),
    ("+ GEMV for every projection (Triton or cuBLAS per shape, timed)", "gemv-linear", True),
    ("+ GEMV, silu*mul fused into down", "gemv-linear-act", True),
    ("+ GEMV, silu*mul and add+norm fused (each per shape against its unfused path)", "gemv", True),
    ("+ GEMV fused, split-KV attention (splits from the batch size)", "gemv-split-kv", True),
    ("+ GEMV fused, split-KV, dependent launch (pdl 1: wait, then schedule the next kernel)", "gemv-split-kv-pdl",
     True),
    ("+ GEMV fused, split-KV, dependent launch (pdl 1), o_proj read into L2 during the attention",
     "gemv-split-kv-pdl-prefetch", True),
    ("+ GEMV fused, split-KV, pdl 1, rotary_attention (rotary, KV store, attention, merge: one launch)",
     "dense-decode", True),
    ("+ GEMV fused, split-KV, pdl 1, rotary_attention, the projections' weights evict-first, o_proj read into "
     "L2 during the attention, its join at the step's end", "dense-decode-evict", True),
    ("the MoE's best form (moe_decode_params: pdl 2, whole-row projection tiles, o_proj and the next QKV into "
     "L2, joined at the step's end), the attention in two launches", "moe-decode-two-launch-attention", True),
    ("the MoE's best form (TRITON_MOE_DECODE: + rotary_attention, its cache tile before the wait)", "moe-decode",
     True),
)


@section
def llama8b_decode(m: Llama8B, bw: float, quick: bool = False):
    from engine import SamplingParams

    eng = m.engine
    prompt, new = list(range(1, 129)), 128
    kv_bytes = m.mcfg.kv_bytes_per_token(2) * (len(prompt) + new / 2)
    roofline = bw / (m.weight_bytes + kv_bytes)
    strict = bw / (m.weight_bytes - m.embed_bytes + kv_bytes)
    row("8B roofline, batch-1 decode (copy bw / all weight + KV bytes per token)", f"{roofline:.1f} tok/s")
    row("8B stricter roofline (embedding table not counted: one row is read)", f"{strict:.1f} tok/s")
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        want = m.hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                             cache_implementation="static")[0, len(prompt):].tolist()
    base = eng.variant
    specs = [("reference kernels, eager", base, False)] + [  # (label, spec, run ahead)
        (f"{label} ({name})", preset_variant(name, m.mcfg.hidden_size, base=base,
                                             cuda_graph_batch_sizes=GRAPH_SIZES if graphs else ()), True)
        for label, name, graphs in FORMS]
    if quick:  # the best forms only, no transformers rows
        specs = specs[-5:]
    best = (0.0, None, "")
    for name, spec, ahead in specs:
        eng.config = dataclasses.replace(eng.config, async_decode=ahead)
        try:
            eng.apply_variant(spec)
            eng.block_manager.reset_prefix_cache()  # a cached prompt would be computed by other kernel shapes
            got = eng.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
            tps = max(decode_tps(eng, prompt, new) for _ in range(2))
        except Exception as e:  # report the form and go on with the next
            traceback.print_exc()
            row(f"8B decode b=1 [{name}]", f"FAILED {type(e).__name__}: {str(e)[:160]}")
            continue
        agree = sum(a == b for a, b in zip(got, want))
        if tps > best[0]:
            best = (tps, spec, name)
        row(f"8B decode b=1 [{name}]", f"{tps:.1f} tok/s = {100 * tps / roofline:.1f}% roofline "
            f"({100 * tps / strict:.1f}% strict); greedy agree w/ HF {agree}/16")
        if eng.runner.graphs is not None:
            graph, _ = eng.runner.graphs.graphs[1]
            replay = timed(graph.replay, iters=50)
            row(f"8B decode b=1 [{name}] graph replay alone",
                f"{1 / replay:.1f} tok/s = {100 / replay / roofline:.1f}% roofline; host time not hidden "
                f"{1e3 * max(0.0, 1 / tps - replay):.3f} ms/token")
    hf_rates = {}
    for label, extra in () if quick else (("eager", {"disable_compile": True}), ("auto-compiled", {})):
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                  cache_implementation="static", **extra)
        with torch.no_grad():
            t = time.perf_counter()
            m.hf.generate(ids, **kw)
            torch.cuda.synchronize()
            warm = time.perf_counter() - t
            t = time.perf_counter()
            m.hf.generate(ids, **kw)
            torch.cuda.synchronize()
            hf_rates[label] = new / (time.perf_counter() - t)
        row(f"8B transformers generate, static cache, {label}, b=1 (incl. prefill)",
            f"{hf_rates[label]:.1f} tok/s = {100 * hf_rates[label] / roofline:.0f}% roofline (warm-up {warm:.0f} s)")
    from kernels.linear import linear_triton as lt
    row("GEMV: the engine's per-shape choice (True: Triton beat the plain-torch path)",
        "; ".join(f"{k_[1]}x{k_[2]} rows {k_[0]} prologue {k_[3]}: {v}" for k_, v in lt._FASTER.items()) or "none")
    row(f"8B best decode b=1: [{best[2]}]", f"{best[0]:.1f} tok/s = {100 * best[0] / roofline:.1f}% roofline, "
        f"{100 * best[0] / strict:.1f}% of the stricter one")
    if hf_rates:
        row("8B best decode / transformers static (best of the two)", f"{best[0] / max(hf_rates.values()):.2f}x")
    eng.config = dataclasses.replace(eng.config, async_decode=True)
    return best[1]
