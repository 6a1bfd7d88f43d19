"""GPU benchmark in one script: correctness first, then figures, then one table.

    python bench/gpu_bench.py [--out DIR] [--only SECTION,...]

1. Correctness on the GPU: each Triton kernel against its plain-torch reference (bf16); a tiny
   Llama and a tiny Qwen3-MoE through the engine (Triton kernels, CUDA graphs, decode run ahead
   of the host) against transformers' greedy tokens (fp32); a graph batch against each request alone.
2. Copy bandwidth and bf16 matmul throughput, measured in this run.
3. Decode attention bandwidth at 4k and 32k context against torch SDPA.
4. Llama-3.1-8B-shaped model, random bf16 weights: batch-1 decode as a fraction of the roofline
   (weight + KV bytes per token over the copy bandwidth), against transformers with a static cache
   on the same weights.
5. The same model: offline throughput on the Azure conversation trace's request lengths against
   transformers' eager batched generate; prefill MFU.
6. Cold start in a fresh process (python, imports, CUDA init, safetensors load, Triton JIT with an
   empty cache, graph capture, first token) against a forward hot swap prepared while serving.
7. Qwen3-30B-A3B-shaped MoE, random bf16 weights: batch-1 decode against the active-parameter roofline.

Every row is appended to DIR/gpu_bench.jsonl as soon as it is measured.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from engine.variant import TRITON_ALL, TRITON_GEMV, TRITON_MOE_DECODE, moe_decode_params, with_pdl

ROWS: list[tuple[str, str]] = []
OUT = Path("/tmp")
LOG = "gpu_bench"  # rows go to OUT/LOG.jsonl as measured, the table to OUT/LOG.json at the end
ROOT = Path(__file__).resolve().parent.parent
DATASHEET_BF16 = 989e12  # H100/H200 SXM dense bf16, FLOP/s
BEST_ATTN = {"attention": {"block_n": 128, "num_warps": 8}}
GRAPH_SIZES = (1, 2, 4, 8)


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"{name:70} {value}", flush=True)
    with open(OUT / f"{LOG}.jsonl", "a") as f:
        f.write(json.dumps([name, value]) + "\n")


def timed(fn, iters=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def graph_timed(fn, calls=20) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (no host launch cost)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, iters=5, warmup=2) / calls


def section(fn):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        except Exception as e:  # keep going: every section reports on its own
            traceback.print_exc()
            row(f"{fn.__name__} FAILED", f"{type(e).__name__}: {str(e)[:160]}")
        finally:
            print(f"[{fn.__name__}: {time.perf_counter() - t:.1f} s]", flush=True)
    run.__name__ = fn.__name__
    return run


# ---- 1. correctness ---------------------------------------------------------------------------------
def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32; infinite when either holds a NaN or an infinity (a NaN would vanish in max())."""
    d = (a.float() - b.float()).abs()
    return d.max().item() if bool(torch.isfinite(d).all()) else float("inf")


@section
def kernel_checks() -> bool:
    from kernels.activation import silu_and_mul_ref
    from kernels.activation_triton import silu_and_mul_triton
    from kernels.attention import AttentionMetadata, paged_attention_ref
    from kernels.attention_triton import paged_attention_triton, split_kv_attention_triton
    from kernels.moe import moe_ref
    from kernels.moe_triton import moe_triton
    from kernels.norm import fused_add_rms_norm_ref
    from kernels.norm_triton import fused_add_rms_norm_triton
    from kernels.rotary import rotary_store_kv_ref
    from kernels.rotary_triton import rotary_store_kv_triton

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(7, 4096, device=dev, dtype=bf)
    r, w = torch.randn_like(x), torch.randn(4096, device=dev, dtype=bf)
    e_norm = err(fused_add_rms_norm_triton(x, r, w, 1e-5)[0], fused_add_rms_norm_ref(x, r, w, 1e-5)[0])
    g = torch.randn(5, 2 * 14336, device=dev, dtype=bf)
    e_act = err(silu_and_mul_triton(g), silu_and_mul_ref(g))
    heads, kvh, d, bs = 32, 8, 128, 16
    ctx = [1, 17, 300, 1000]
    nb = [-(-c // bs) for c in ctx]
    kc = torch.randn(sum(nb) + 2, bs, kvh, d, device=dev, dtype=bf)
    vc = torch.randn_like(kc)
    perm = torch.randperm(sum(nb) + 2).tolist()
    tables, off = [], 0
    for n in nb:
        tables.append(perm[off:off + n] + [0] * (max(nb) - n))
        off += n
    bt = torch.tensor(tables, dtype=torch.int32, device=dev)
    qsl = [0]
    for n in (1, 17, 1, 5):
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, d, device=dev, dtype=bf)
    meta = AttentionMetadata.build(torch.zeros(qsl[-1], dtype=torch.int64, device=dev), bt, ctx, qsl, dev)
    ref = paged_attention_ref(q, kc, vc, meta, d ** -0.5).float()
    e_pre = err(paged_attention_triton(q, kc, vc, meta, d ** -0.5), ref)
    last = [qsl[i + 1] - 1 for i in range(len(ctx))]
    dmeta = AttentionMetadata.build(meta.slot_mapping[:len(ctx)], bt, ctx, list(range(len(ctx) + 1)), dev)
    dq = q[last].contiguous()
    dref = paged_attention_ref(dq, kc, vc, dmeta, d ** -0.5).float()
    e_dec = max(err(paged_attention_triton(dq, kc, vc, dmeta, d ** -0.5, block_n=128, num_warps=8), dref),
                err(split_kv_attention_triton(dq, kc, vc, dmeta, d ** -0.5, num_splits=4), dref))
    # fused rotary + KV store, on strided views of a fused QKV projection
    from engine.config import ModelConfig
    from engine.rope import rope_cos_sin

    cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=heads * d, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kvh, head_dim=d)
    cs = rope_cos_sin(cfg, 4096, dev)
    qkv = torch.randn(5, (heads + 2 * kvh) * d, device=dev, dtype=bf)
    qv, kv_, vv = (qkv[:, :heads * d].view(5, heads, d), qkv[:, heads * d:(heads + kvh) * d].view(5, kvh, d),
                   qkv[:, (heads + kvh) * d:].view(5, kvh, d))
    pos = torch.tensor([0, 7, 100, 1000, 4000], device=dev)
    slots = torch.tensor([3, 40, 77, 100, 5], device=dev)
    caches = [torch.zeros(8, bs, kvh, d, device=dev, dtype=bf) for _ in range(4)]
    a = rotary_store_kv_triton(qv, kv_, vv, pos, cs, caches[0], caches[1], slots)
    b = rotary_store_kv_ref(qv, kv_, vv, pos, cs, caches[2], caches[3], slots)
    e_rot = max(err(a, b), err(caches[0], caches[2]), err(caches[1], caches[3]))
    # the attention block in one launch (q/k norms, rotary, KV store, split-KV decode; the splits merged by the
    # merge kernel after or by the last split) against the reference, Qwen3-30B-A3B's heads, with dependent
    # launch, twice per setting (the last split's counters are reset by the kernel)
    from kernels.attention import rotary_attention_ref
    from kernels.attention_triton import rotary_attention_triton
    from kernels.counters import ArrivalCounters

    qh, qkvh = 32, 4
    kc3 = torch.randn(sum(nb) + 2, bs, qkvh, d, device=dev, dtype=bf)
    vc3 = torch.randn_like(kc3)
    qkv3 = torch.randn(len(ctx), (qh + 2 * qkvh) * d, device=dev, dtype=bf)
    q3, k3, v3 = (qkv3[:, :qh * d].view(-1, qh, d), qkv3[:, qh * d:(qh + qkvh) * d].view(-1, qkvh, d),
                  qkv3[:, (qh + qkvh) * d:].view(-1, qkvh, d))
    qw3, kw3 = (1 + 0.1 * torch.randn(d, device=dev)).to(bf), (1 + 0.1 * torch.randn(d, device=dev)).to(bf)
    slots3 = torch.tensor([int(bt[i, (c - 1) // bs]) * bs + (c - 1) % bs for i, c in enumerate(ctx)], device=dev)
    meta3 = AttentionMetadata.build(slots3, bt, ctx, list(range(len(ctx) + 1)), dev)
    pos3 = torch.tensor([c - 1 for c in ctx], device=dev)
    rk, rv = kc3.clone(), vc3.clone()
    ref3 = rotary_attention_ref(q3, k3, v3, qw3, kw3, 1e-6, pos3, cs, rk, rv, meta3, d ** -0.5).float()
    counters, e_ra = ArrivalCounters(), 0.0
    for splits, by_last in ((1, 0), (4, 0), (0, 0), (4, 1), (0, 1)):
        for _ in range(2):
            gk, gv = kc3.clone(), vc3.clone()
            got3 = rotary_attention_triton(q3, k3, v3, qw3, kw3, 1e-6, pos3, cs, gk, gv, meta3, d ** -0.5,
                                           num_splits=splits, merge_by_last=by_last, pdl=2, counters=counters)
            torch.cuda.synchronize()
            e_ra = max(e_ra, err(got3, ref3))
            e_rot = max(e_rot, err(gk, rk), err(gv, rv))
    e_dec = max(e_dec, e_ra)  # reported with the decode kernels, the cache writes with rotary + KV store
    # MoE: decode path (per-pair kernels) and grouped path, Qwen3-30B-A3B shapes
    xm = torch.randn(3, 2048, device=dev, dtype=bf)
    lg = torch.randn(3, 128, device=dev, dtype=bf)
    w13 = torch.randn(128, 1536, 2048, device=dev, dtype=bf) * 0.02
    w2 = torch.randn(128, 2048, 768, device=dev, dtype=bf) * 0.02
    mref = moe_ref(xm, lg, w13, w2, 8, True).float()
    e_moe = max(err(moe_triton(xm, lg, w13, w2, 8, True), mref),
                err(moe_triton(xm, lg, w13, w2, 8, True, max_decode_pairs=0), mref),
                err(moe_triton(xm, lg, w13, w2, 8, True, decode_split_down=2, decode_down_early=1, pdl=2), mref),
                err(moe_triton(xm, lg, w13, w2, 8, True, decode_split_down=2, decode_route_rank=1, decode_evict=1,
                               pdl=2), mref),
                err(moe_triton(xm, lg, w13, w2, 8, True, decode_split_down=2, decode_evict=1, decode_act=1,
                               decode_block_n=2, decode_block_k=2048, decode_down_block_n=16, pdl=2), mref))
    # the experts in one launch, twice with the kept float32 sum and counter (the kernel re-zeroes them)
    from kernels.moe_triton import make_moe

    one = make_moe(decode_split_down=3, decode_chunk=48, decode_block_k=256, decode_down_block_n=128, pdl=2)
    for t_ in (1, 3, 3):
        e_moe = max(e_moe, err(one(xm[:t_], lg[:t_], w13, w2, 8, True), mref[:t_]))
    scale = mref.abs().max().item()
    # the MoE block after attention (norm + router + routing in one launch, sum by the last pair's program),
    # float32 so that no routing decision sits within rounding of a tie; with dependent launch
    from kernels.moe import norm_moe_ref
    from kernels.moe_triton import norm_moe_triton

    f32 = dict(device=dev, dtype=torch.float32)
    xs, rs, nws = torch.randn(3, 2048, **f32), torch.randn(3, 2048, **f32), torch.randn(2048, **f32)
    gws, w13s, w2s = torch.randn(128, 2048, **f32) * 0.02, w13.float(), w2.float()
    nref, nsum = norm_moe_ref(xs, rs, nws, 1e-6, gws, w13s, w2s, 8, True)
    e_nmoe = 0.0
    for t_ in (1, 3):
        for split, route_by_last, rank in ((1, 1, 0), (2, 1, 0), (2, 0, 0), (3, 1, 0), (2, 0, 1), (2, 0, 2)):
            o_, s_ = norm_moe_triton(xs[:t_], rs[:t_], nws, 1e-6, gws, w13s, w2s, 8, True, decode_split_down=split,
                                     route_by_last=route_by_last, decode_route_rank=rank == 1,
                                     decode_evict=rank == 1, decode_act=rank == 2, pdl=1)
            e_nmoe = max(e_nmoe, err(o_, nref[:t_]) / nref.abs().max().item(), err(s_, nsum[:t_]))
    del w13s, w2s
    # the L2 prefetch kernel reads every element once (its per-program sums add up)
    from kernels.prefetch_triton import prefetch_sums

    wp = torch.randn(4096 * 4096 + 77, device=dev, dtype=bf)
    e_pf = abs(prefetch_sums(wp, programs=528, block=4096).double().sum().item() - wp.double().sum().item())
    e_nmoe = max(e_nmoe, e_pf / 1e3)  # reported with norm_moe; the sum of 16.8M bf16 values is ~1e3 in size
    # decode matrix-vector kernels (autotuned tiles), alone and with the norm / activation fused in; error
    # relative to the output's scale, since bf16 outputs of sums over 4096-14336 terms round at ~1e-2
    from kernels.linear import act_linear_ref, linear_ref, norm_linear_ref
    from kernels.linear_triton import act_linear_triton, linear_triton, norm_linear_triton

    e_gemv = 0.0
    for rows_ in (1, 3):
        xl, rl = torch.randn(rows_, 4096, device=dev, dtype=bf), torch.randn(rows_, 4096, device=dev, dtype=bf)
        wl, nw = torch.randn(6144, 4096, device=dev, dtype=bf) * 0.02, torch.randn(4096, device=dev, dtype=bf)
        wd, gu = torch.randn(4096, 14336, device=dev, dtype=bf) * 0.02, torch.randn(rows_, 28672, device=dev, dtype=bf)
        pairs = [(linear_triton(xl, wl), linear_ref(xl, wl)),
                 (norm_linear_triton(xl, rl, nw, 1e-5, wl)[0], norm_linear_ref(xl, rl, nw, 1e-5, wl)[0]),
                 (norm_linear_triton(xl, rl, nw, 1e-5, wl)[1], norm_linear_ref(xl, rl, nw, 1e-5, wl)[1]),
                 (act_linear_triton(gu, wd), act_linear_ref(gu, wd))]
        e_gemv = max([e_gemv] + [err(a_, b_) / b_.float().abs().max().item()
                                 for a_, b_ in pairs])
    # attention outputs in bf16 against a float32 reference: a couple of bf16 steps at the outputs' magnitude
    # (the probabilities enter P @ V in bf16; sequences of one key return a value row of randn, up to ~5)
    att_tol = 2 ** -6 * max(2.0, ref.abs().max().item(), dref.abs().max().item())
    ok = (e_norm < 0.1 and e_act < 0.1 and e_pre < att_tol and e_dec < att_tol and e_rot < 0.05
          and e_moe < 0.02 * scale + 1e-3 and e_gemv < 0.02 and e_nmoe < 1e-4)
    row("kernels vs reference, bf16 max abs err (norm/act/prefill/decode/rot+kv/moe/gemv rel.; norm_moe fp32 rel.)",
        f"{e_norm:.3g} / {e_act:.3g} / {e_pre:.3g} / {e_dec:.3g} / {e_rot:.3g} / {e_moe:.3g} (|moe| {scale:.2g}) / "
        f"{e_gemv:.3g}; {e_nmoe:.3g} (attention tolerance {att_tol:.3g}) -> {'OK' if ok else 'MISMATCH'}")
    return ok


@section
def tiny_models_vs_transformers(tmp: Path) -> bool:
    import transformers as tf
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.variant import VariantSpec

    cfgs = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                                      num_hidden_layers=4, num_attention_heads=8,
                                                      num_key_value_heads=2, max_position_embeddings=512)),
        "qwen3_moe": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
            num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512)),
    }
    all_ok = True
    for name, (cls, cfg) in cfgs.items():
        torch.manual_seed(0)
        hf = cls(cfg).eval()
        with torch.no_grad():
            for p_ in hf.parameters():
                if p_.dim() == 1:
                    p_.add_(torch.randn_like(p_) * 0.1)
        folder = tmp / name
        hf.save_pretrained(folder)
        hf = hf.cuda()
        ids = torch.randint(0, 1000, (40,)).tolist()
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
        spec = VariantSpec(kernels={**TRITON_ALL, **TRITON_GEMV})
        graphs = dataclasses.replace(spec, cuda_graph_batch_sizes=(1, 2, 4))
        pdl_params = with_pdl({"attention": {"num_splits": 0}, "rotary_attention": {"num_splits": 0},
                               "moe": {"decode_split_down": 2, "decode_down_early": 1}}, 2)
        pdl = dataclasses.replace(graphs, kernels={**TRITON_ALL, **TRITON_GEMV, "prefetch": "triton",
                                                   "rotary_attention": "triton"},
                                  kernel_params=pdl_params)
        one = {"decode_split_down": 3, "decode_chunk": 48, "decode_block_k": 256, "decode_down_block_n": 128}
        pdl_one = dataclasses.replace(pdl, kernel_params={**pdl_params, "moe": {**one, "pdl": 2}})
        own = {"decode_split_down": 2, "decode_route_rank": 1, "decode_evict": 1, "decode_act": 1, "pdl": 2}
        pdl_own = dataclasses.replace(pdl, kernel_params={**pdl_params, "moe": own, "linear": {"evict": 1, "pdl": 2},
                                                          "norm_linear": {"evict": 1, "pdl": 2},
                                                          "prefetch": {"next_qkv": 1, "defer_join": 1}})
        results = {}
        for label, variant, ahead in (("reference", None, False), ("triton", spec, True),
                                      ("triton+graphs", graphs, False), ("triton+graphs+pdl", pdl, False),
                                      ("triton+graphs+pdl, experts in one launch", pdl_one, False),
                                      ("triton+graphs+pdl, routing by rank, weights evict-first, activation in "
                                       "gate/up, prefetch joins deferred", pdl_own, False),
                                      ("triton+graphs+ahead", graphs, True)):
            try:
                eng = LLMEngine(EngineConfig(source=resolve(str(folder)), device="cuda", num_kv_blocks=64,
                                             variant=variant, async_decode=ahead))
                results[label] = eng.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True)
                                              )[0].token_ids == want
            except Exception as e:  # a form that fails is reported as such; the others go on
                traceback.print_exc()
                results[label] = f"FAILED {type(e).__name__}"
                continue
            if label == "triton+graphs+ahead":
                # a batch of 3 replays the padded 4-graph, rows stop at different steps: each equals its run alone
                prompts = [ids, ids[:20], ids[5:]]
                params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 4, 12)]
                batch = [o.token_ids for o in eng.generate(prompts, params)]
                alone = [eng.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
                results["batch == alone"] = batch == alone
        # dependent launch is a newer form: its result is reported, and the figures that use it check their
        # own greedy tokens; the other forms gate the model figures
        ok = all(v is True for k_, v in results.items() if not k_.startswith("triton+graphs+pdl"))
        all_ok &= ok
        row(f"tiny {name} fp32: greedy == transformers; graph batch == alone",
            ", ".join(f"{k} {v}" for k, v in results.items()) + f" -> {'OK' if ok else 'MISMATCH'}")
    return all_ok


# ---- 2. machine figures -----------------------------------------------------------------------------
@section
def machine() -> tuple[float, float]:
    n = 2 * 1024 ** 3
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    bw = 2 * n / timed(lambda: b.copy_(a), iters=20)
    a = b = None
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m ** 3 / timed(lambda: x @ y, iters=20)
    x = y = None
    row("copy bandwidth (read + write)", f"{bw / 1e9:,.0f} GB/s")
    row("bf16 dense matmul 8192^3 (measured peak)", f"{flops / 1e12:,.0f} TFLOP/s "
        f"({100 * flops / DATASHEET_BF16:.0f}% of the 989 datasheet)")
    return bw, flops


@section
def attention_bandwidth():
    import torch.nn.functional as F
    from kernels.attention import AttentionMetadata
    from kernels.attention_triton import paged_attention_triton, split_kv_attention_triton

    heads, kvh, d, bs, batch = 32, 8, 128, 16, 8
    for ctx in (4096, 32768):
        nb = ctx // bs
        kc = torch.randn(batch * nb, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.arange(batch * nb, dtype=torch.int32, device="cuda").view(batch, nb)
        q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
        meta = AttentionMetadata.build(torch.zeros(batch, dtype=torch.int64, device="cuda"), bt, [ctx] * batch,
                                       list(range(batch + 1)), "cuda")
        nbytes = 2 * batch * ctx * kvh * d * 2
        res = {"paged": timed(lambda: paged_attention_triton(q, kc, vc, meta, d ** -0.5, block_n=128, num_warps=8))}
        for s in (8, 32):
            res[f"split{s}"] = timed(lambda: split_kv_attention_triton(q, kc, vc, meta, d ** -0.5, num_splits=s,
                                                                         block_n=64))
        k = kc.view(batch, ctx, kvh, d).transpose(1, 2)
        v = vc.view(batch, ctx, kvh, d).transpose(1, 2)
        qq = q.view(batch, heads, 1, d)
        res["sdpa"] = timed(lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True))
        row(f"decode attention {ctx // 1024}k ctx, batch {batch}: GB/s",
            ", ".join(f"{n} {nbytes / s / 1e9:,.0f}" for n, s in res.items()))


def rotating_timed(calls: list) -> float:
    """Seconds per call of ``calls`` (each on its own copy of the weights, so none is served from L2),
    replayed from one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return timed(graph.replay, iters=5, warmup=2) / len(calls)


@section
def gemv_bandwidth(bw: float):
    """The 8B model's decode projections at batch 1: our matrix-vector kernels against cuBLAS."""
    import torch.nn.functional as F
    from kernels import linear_triton as lt

    dev, bf = "cuda", torch.bfloat16
    x, r, nw = (torch.randn(1, 4096, device=dev, dtype=bf) for _ in range(3))
    nw = nw[0]
    gu = torch.randn(1, 28672, device=dev, dtype=bf)
    act = gu[:, :14336].contiguous()
    for name, n, k, prologue in (("qkv", 6144, 4096, lt.NONE), ("qkv, norm fused", 6144, 4096, lt.ADD_RMS_NORM),
                                 ("o_proj", 4096, 4096, lt.NONE), ("gate_up", 28672, 4096, lt.NONE),
                                 ("gate_up, norm fused", 28672, 4096, lt.ADD_RMS_NORM),
                                 ("down, silu*mul fused", 4096, 14336, lt.SILU_MUL), ("lm_head", 128256, 4096, lt.NONE)):
        nbytes = n * k * 2
        ws = [torch.randn(n, k, device=dev, dtype=bf) * 0.02 for _ in range(max(2, -(-400_000_000 // nbytes)))]
        xi = act if prologue == lt.SILU_MUL else x
        t_ref = rotating_timed([lambda w=w: F.linear(xi, w) for w in ws])
        if prologue == lt.ADD_RMS_NORM:
            ours = [lambda w=w: lt._gemv(x, w, None, prologue, {}, r=r, norm_weight=nw, eps=1e-5) for w in ws]
        elif prologue == lt.SILU_MUL:
            ours = [lambda w=w: lt._gemv(gu, w, None, prologue, {}, k=k) for w in ws]
        else:
            ours = [lambda w=w: lt._gemv(x, w, None, prologue, {}) for w in ws]
        t_ours = rotating_timed(ours)
        cfg = lt._gemv_tuned.best_config
        row(f"GEMV b=1 {name} {n}x{k} ({nbytes / 1e6:.0f} MB): GB/s (% of copy bw)",
            f"cuBLAS {nbytes / t_ref / 1e9:,.0f} ({100 * nbytes / t_ref / bw:.0f}%), Triton {nbytes / t_ours / 1e9:,.0f} "
            f"({100 * nbytes / t_ours / bw:.0f}%) [{cfg.kwargs}, {cfg.num_warps} warps]")
        del ws


# ---- 4. 8B decode -----------------------------------------------------------------------------------
class Llama8B:
    """The transformers model with random bf16 weights, and our engine assembled from the same tensors."""

    def __init__(self) -> None:
        import transformers as tf
        from engine import EngineConfig, LLMEngine
        from engine.config import ModelConfig
        from engine.llm_engine import LoadedModel
        from engine.loader import PRESETS_DIR, resolve
        from engine.weights import assemble

        self.raw = json.loads((PRESETS_DIR / "llama-3.1-8b.json").read_text())
        hf_cfg = tf.LlamaConfig(**{k: v for k, v in self.raw.items() if k != "architectures"})
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            self.hf = tf.LlamaForCausalLM(hf_cfg).eval()
        torch.set_default_dtype(torch.float32)
        with torch.no_grad():
            for p_ in self.hf.parameters():  # transformers initialises norms to 1; spread them as trained ones are
                if p_.dim() == 1:
                    p_.add_(torch.randn_like(p_) * 0.05)
        self.mcfg = ModelConfig.from_hf_dict(self.raw)
        t0 = time.perf_counter()
        model = assemble(self.mcfg, self.hf.state_dict().items(), torch.device("cuda"), torch.bfloat16)
        self.loaded = LoadedModel(self.mcfg, model, None, time.perf_counter() - t0)
        self.config = EngineConfig(source=resolve("llama-3.1-8b"), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                   load_tokenizer=False)
        self.engine = LLMEngine(self.config, self.loaded)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.embed_bytes = model.embed_tokens.weight.numel() * 2


def decode_tps(eng, prompt, new, SamplingParams) -> float:
    eng.add_request(prompt, SamplingParams(max_tokens=new, ignore_eos=True))
    eng.step()  # prefill
    torch.cuda.synchronize()
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    return (new - 1) / (time.perf_counter() - t)


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
    graphs = dataclasses.replace(base, kernels=TRITON_ALL, kernel_params=BEST_ATTN, cuda_graph_batch_sizes=GRAPH_SIZES)
    gemv = dataclasses.replace(graphs, kernels={**TRITON_ALL, **TRITON_GEMV})
    specs = [  # (label, spec, run ahead)
        ("reference kernels, eager", base, False),
        ("triton, eager, ahead", dataclasses.replace(base, kernels=TRITON_ALL, kernel_params=BEST_ATTN), True),
        ("triton + graphs, fused rotary+store_kv, ahead (previous best)", graphs, True),
        ("+ GEMV for every projection (Triton or cuBLAS per shape, timed)",
         dataclasses.replace(graphs, kernels={**TRITON_ALL, "linear": "triton"}), True),
        ("+ GEMV, silu*mul fused into down", dataclasses.replace(
            graphs, kernels={**TRITON_ALL, "linear": "triton", "act_linear": "triton"}), True),
        ("+ GEMV, silu*mul and add+norm fused (each per shape against its unfused path)", gemv, True),
        ("+ GEMV fused, split-KV attention (splits from the batch size)",
         dataclasses.replace(gemv, kernel_params={"attention": {"num_splits": 0, "block_n": 32}}), True),
        ("+ GEMV fused, split-KV, dependent launch (pdl 1: wait, then schedule the next kernel)",
         dataclasses.replace(gemv, kernel_params=with_pdl({"attention": {"num_splits": 0, "block_n": 32}})), True),
        ("+ GEMV fused, split-KV, dependent launch (pdl 1), o_proj read into L2 during the attention",
         dataclasses.replace(gemv, kernels={**TRITON_ALL, **TRITON_GEMV, "prefetch": "triton"},
                             kernel_params=with_pdl({"attention": {"num_splits": 0, "block_n": 32}})), True),
        ("+ GEMV fused, split-KV, pdl 1, rotary_attention (rotary, KV store, attention, merge: one launch)",
         dataclasses.replace(gemv, kernels={**TRITON_ALL, **TRITON_GEMV, "rotary_attention": "triton"},
                             kernel_params=with_pdl({"attention": {"num_splits": 0, "block_n": 32},
                                                     "rotary_attention": {"num_splits": 0, "block_n": 32}})), True),
        ("+ GEMV fused, split-KV, pdl 1, rotary_attention, the projections' weights evict-first, o_proj read into "
         "L2 during the attention, its join at the step's end", dataclasses.replace(
             gemv, kernels={**TRITON_ALL, **TRITON_GEMV, "rotary_attention": "triton", "prefetch": "triton"},
             kernel_params={**with_pdl({"attention": {"num_splits": 0, "block_n": 32},
                                        "rotary_attention": {"num_splits": 0, "block_n": 32},
                                        **{op: {"evict": 1} for op in ("linear", "norm_linear", "act_linear")}}),
                            "prefetch": {"defer_join": 1}}), True),
        ("the MoE's best form (moe_decode_params: pdl 2, whole-row projection tiles, o_proj and the next QKV into "
         "L2, joined at the step's end), the attention in two launches",
         dataclasses.replace(gemv, kernels={**TRITON_ALL, **TRITON_GEMV, "prefetch": "triton"},
                             kernel_params=moe_decode_params({"num_splits": 0, "block_n": 32}, 4096)), True),
        ("the MoE's best form (TRITON_MOE_DECODE: + rotary_attention, its cache tile before the wait)",
         dataclasses.replace(gemv, kernels=TRITON_MOE_DECODE,
                             kernel_params=moe_decode_params({"num_splits": 0, "block_n": 32}, 4096)), True),
    ]
    if quick:  # the best forms only, no transformers rows
        specs = specs[-5:]
    best = (0.0, None, "")
    for name, spec, ahead in specs:
        eng.config = dataclasses.replace(eng.config, async_decode=ahead)
        try:
            eng.apply_variant(spec)
            eng.block_manager.reset_prefix_cache()  # a cached prompt would be computed by other kernel shapes
            got = eng.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
            tps = max(decode_tps(eng, prompt, new, SamplingParams) for _ in range(2))
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
    from kernels import linear_triton as lt

    row("GEMV: the engine's per-shape choice (True: Triton beat the plain-torch path)",
        "; ".join(f"{k_[1]}x{k_[2]} rows {k_[0]} prologue {k_[3]}: {v}" for k_, v in lt._FASTER.items()) or "none")
    row(f"8B best decode b=1: [{best[2]}]", f"{best[0]:.1f} tok/s = {100 * best[0] / roofline:.1f}% roofline, "
        f"{100 * best[0] / strict:.1f}% of the stricter one")
    if hf_rates:
        row("8B best decode / transformers static (best of the two)", f"{best[0] / max(hf_rates.values()):.2f}x")
    eng.config = dataclasses.replace(eng.config, async_decode=True)
    return best[1]


# ---- 5. throughput and MFU --------------------------------------------------------------------------
def trace_requests(path: Path, n: int, max_in: int, max_out: int) -> list[tuple[int, int]]:
    with open(path) as f:
        rows = list(csv.DictReader(f))[:n]
    return [(min(int(r["ContextTokens"]), max_in), max(1, min(int(r["GeneratedTokens"]), max_out))) for r in rows]


@section
def llama8b_throughput(m: Llama8B, trace: Path, peak: float, n: int, hf_batch: int):
    from engine import LLMEngine, SamplingParams
    from engine.variant import VariantSpec

    reqs = trace_requests(trace, n, 2048, 256)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (i,), generator=gen).tolist() for i, _ in reqs]
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
    out_tokens = sum(o for _, o in reqs)
    in_tokens = sum(i for i, _ in reqs)
    spec = VariantSpec(kernels=TRITON_ALL, kernel_params=BEST_ATTN, max_num_seqs=128, max_num_batched_tokens=8192,
                       cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128))
    blocks = sum(-(-(i + o) // 16) for i, o in reqs) + 64
    t = time.perf_counter()
    eng = LLMEngine(dataclasses.replace(m.config, num_kv_blocks=blocks, variant=spec), m.loaded)
    eng.generate([prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True))  # prefill kernels JIT
    build = time.perf_counter() - t
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    torch.cuda.synchronize()
    ours = time.perf_counter() - t
    assert sum(len(o.token_ids) for o in outs) == out_tokens
    row(f"8B offline, {n} Azure-conv requests (in<=2048, out<=256; {in_tokens} in, {out_tokens} out tokens)",
        f"ours {ours:.1f} s = {out_tokens / ours:,.0f} output tok/s, {(in_tokens + out_tokens) / ours:,.0f} total "
        f"tok/s (engine build + graphs {build:.1f} s, not counted)")
    # transformers: eager batched generate, left-padded batches in trace order, each to its longest output
    hf = m.hf
    t = time.perf_counter()
    with torch.no_grad():
        for s in range(0, n, hf_batch):
            chunk = prompts[s:s + hf_batch]
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(chunk):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            longest = max(o for _, o in reqs[s:s + hf_batch])
            hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=longest, min_new_tokens=longest,
                        do_sample=False, eos_token_id=None, pad_token_id=0, disable_compile=True)
    torch.cuda.synchronize()
    theirs = time.perf_counter() - t
    row(f"8B offline, transformers eager batched generate (batches of {hf_batch}, counted: requested tokens)",
        f"{theirs:.1f} s = {out_tokens / theirs:,.0f} output tok/s")
    row("8B offline throughput, ours / transformers eager", f"{theirs / ours:.2f}x")
    # prefill-heavy MFU: 16 prompts of 2048 tokens, one output token each, 8192-token steps
    cfg = m.mcfg
    n_p, length = 16, 2048
    pp = [torch.randint(0, 128000, (length,), generator=gen).tolist() for _ in range(n_p)]
    eng.generate(pp[:2], SamplingParams(max_tokens=1, ignore_eos=True))
    eng.block_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.generate(pp[2:] + pp[:2], SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    linear = sum(p.numel() for name, p in eng.model.named_parameters() if p.dim() == 2 and "embed" not in name
                 and "lm_head" not in name)
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * (length * (length + 1) / 2)
    flops = n_p * (2 * linear * length + attn) + n_p * 2 * cfg.vocab_size * cfg.hidden_size
    achieved = flops / dt
    row(f"8B prefill MFU ({n_p} x {length} tokens, 8192-token steps)",
        f"{achieved / 1e12:,.0f} TFLOP/s = {100 * achieved / peak:.0f}% of measured matmul peak, "
        f"{100 * achieved / DATASHEET_BF16:.0f}% of 989 datasheet ({n_p * length / dt:,.0f} tok/s)")
    del eng
    torch.cuda.empty_cache()


# ---- 6. cold start and hot swap ---------------------------------------------------------------------
def cold_start_child(folder: str, variant_json: str, t0: float) -> None:
    """Runs in a fresh process: everything a restart does, until the first token is ready."""
    marks = {"python start + import torch": time.time() - t0}  # torch is imported at the top of this file
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    marks["CUDA init"] = time.time() - t0
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.variant import VariantSpec

    spec = VariantSpec.from_json(json.loads(variant_json))
    cfg = EngineConfig(source=resolve(folder), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                       load_tokenizer=False, variant=spec)
    eng = LLMEngine(cfg)
    torch.cuda.synchronize()
    marks["engine built (weights, JIT, graphs)"] = time.time() - t0
    marks["weights loaded (part of the above)"] = eng.load_seconds
    eng.generate([list(range(1, 129))], SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    marks["first token"] = time.time() - t0
    print("COLD_START " + json.dumps(marks), flush=True)


def _engine_to_hf(model, cfg) -> dict:
    """The engine's fused weights under Hugging Face names (views, no copies)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm,
           "lm_head.weight": model.lm_head}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        w = layer.self_attn.qkv_proj.weight
        out[p + "self_attn.q_proj.weight"] = w[:q]
        out[p + "self_attn.k_proj.weight"] = w[q:q + kv]
        out[p + "self_attn.v_proj.weight"] = w[q + kv:]
        out[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
        gu = layer.mlp.gate_up_proj.weight
        out[p + "mlp.gate_proj.weight"] = gu[:inter]
        out[p + "mlp.up_proj.weight"] = gu[inter:]
        out[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        out[p + "input_layernorm.weight"] = layer.input_layernorm
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
    return out


@section
def cold_start_and_swap(m: Llama8B, spec, tmp: Path):
    from safetensors.torch import save_file

    from engine import SamplingParams

    folder = tmp / "llama8b"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(m.raw))
    t = time.perf_counter()
    save_file({k: v.contiguous() for k, v in _engine_to_hf(m.engine.model, m.mcfg).items()},
              str(folder / "model.safetensors"))
    row("8B safetensors written for the cold start", f"{time.perf_counter() - t:.1f} s (stays in the page cache)")
    colds = {}
    cache = tempfile.mkdtemp(prefix="triton_cold_")  # empty for the first start, filled by it for the second
    for label in ("empty Triton cache", "warm Triton cache"):
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        t0 = time.time()
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--cold-start", str(folder),
                               "--variant", json.dumps(spec.to_json()), "--t0", repr(t0)],
                              env=env, capture_output=True, text=True, timeout=240)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("COLD_START ")), None)
        if line is None:
            row(f"8B cold start ({label}) FAILED", (proc.stderr or proc.stdout)[-300:])
            continue
        marks = json.loads(line[len("COLD_START "):])
        colds[label] = marks["first token"]
        row(f"8B cold start in a fresh process, {label}: until the first token",
            f"{marks['first token']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in marks.items()
                                                          if k != "first token") + ")")
    # forward hot swap: a new attention configuration (never compiled in this process) prepared in a
    # thread while a request keeps decoding, then switched between two steps
    eng = m.engine
    eng.apply_variant(spec)
    other = dataclasses.replace(spec, kernel_params={"attention": {"block_n": 64, "num_warps": 4, "num_stages": 3}})
    rid = eng.add_request(list(range(300, 428)), SamplingParams(max_tokens=1500, ignore_eos=True))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        eng.step()
    torch.cuda.synchronize()
    step_before = (time.perf_counter() - t) / 50
    box: dict = {}

    def prepare():
        try:
            box["prepared"] = eng.prepare_variant(other)
        except Exception as e:  # reported below
            box["error"] = e

    th = threading.Thread(target=prepare)
    t = time.perf_counter()
    th.start()
    steps = 0
    while th.is_alive():
        eng.step()
        steps += 1
    prep = time.perf_counter() - t
    if "error" in box:
        row("8B hot swap preparation in a thread FAILED", f"{type(box['error']).__name__}: {str(box['error'])[:160]}")
        prepared = None
    else:
        prepared = box["prepared"]
        row("8B forward swap prepared while serving (new attention kernel JIT, warm-up, 4 graphs)",
            f"{prep:.2f} s; {steps} decode steps ran meanwhile ({steps / prep:.0f} tok/s vs "
            f"{1 / step_before:.0f} before)")
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.apply_variant(other, prepared)
    eng.step()
    torch.cuda.synchronize()
    pause = time.perf_counter() - t
    row("8B forward swap, serving pause (switch between steps + the next step)",
        f"{1e3 * pause:.1f} ms (a step is {1e3 * step_before:.1f} ms)")
    # the same swap done inline (prepare inside apply_variant), back to the first spec, kernels compiled already
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.apply_variant(spec)
    eng.step()
    torch.cuda.synchronize()
    inline = time.perf_counter() - t
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    row("8B forward swap done inline (warm-up + 4 graph captures + next step)", f"{1e3 * inline:.0f} ms")
    for label, cold in colds.items():
        row(f"8B swap / cold start ({label})",
            f"pause {100 * pause / cold:.2f}%, inline {100 * inline / cold:.2f}%"
            + (f", prepared in background {100 * prep / cold:.1f}%" if prepared is not None else ""))


def kernel_profile(label: str, fn, steps: int = 5, top: int = 14) -> None:
    """GPU time of each kernel ``fn`` launches (one call = one step), from the CUDA profiler: the kernels a
    step spends its time in, their count per step, and the step's time not covered by any kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            per.setdefault(e.name[:60], []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in per.values()) / steps
    row(f"{label}: kernel time per step", f"{total:.0f} us in {sum(len(v) for v in per.values()) // steps} "
        f"kernels; wall {1e6 * wall:.0f} us (not covered by kernels {1e6 * wall - total:.0f} us)")
    for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        row(f"  {label}: {name}", f"{sum(v) / steps:.0f} us/step, {len(v) / steps:.0f} per step, "
            f"{sum(v) / len(v):.1f} us each, {100 * sum(v) / steps / total:.0f}%")


def experts_timer(eng, cfg):
    """(us(params), bytes): microseconds per call of the experts alone at batch 1 (``make_moe(**params)``: the
    routing, gate/up and down with the sum), each call on another layer's experts, so none is served from L2;
    and the bytes of weights one call reads."""
    from kernels.moe_triton import make_moe

    k_, xs = cfg.num_experts_per_tok, torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    lgs = [torch.randn(1, cfg.num_experts, device="cuda", dtype=torch.bfloat16) for _ in range(24)]
    mlps = [eng.model.layers[i].mlp for i in range(min(24, cfg.num_hidden_layers))]

    def us(params):
        op = make_moe(**params)
        return 1e6 * rotating_timed([lambda m=m, lg=lg: op(xs, lg, m.w13, m.w2, k_, True) for m, lg in zip(mlps, lgs)])

    return us, (k_ * 3 * cfg.moe_intermediate_size) * cfg.hidden_size * 2


def timed_tiles(sweep: list, us, params: dict, label: str) -> None:
    """Appends (us(params), params) to sweep; a tile that does not compile (registers) is reported instead."""
    try:
        sweep.append((us(params), params))
    except Exception as e:
        row(f"{label} {params}", f"FAILED {type(e).__name__}: {str(e)[:100]}")


def experts_sweep(eng, cfg, gemv, pre, best):
    """The experts alone at batch 1 (routing, gate/up, down with the sum), dependent launch, over their tiles
    (``experts_timer``). Returns the forms with the best tiles."""
    timer, moe_bytes = experts_timer(eng, cfg)
    experts_us = lambda params: timer({"decode_split_down": 2, "pdl": 2, **params})  # noqa: E731
    sweep = []
    for bn in (4, 8, 16):
        for bk in (256, 512, 1024, 2048):
            for warps in (4, 8):
                params = dict(decode_block_n=bn, decode_block_k=bk, decode_warps=warps, decode_down_block_n=8,
                              decode_down_block_k=256)
                timed_tiles(sweep, experts_us, params, "MoE experts b=1")
    t0, gu = min(sweep, key=lambda r: r[0])
    current = next((t for t, p_ in sweep if p_["decode_block_n"] == 8 and p_["decode_block_k"] == 256
                    and p_["decode_warps"] == 4), float("nan"))
    row("MoE experts b=1 (routing, gate/up, down + sum; 75.5 MB), gate/up tiles: the current (8, 256, 4 warps) "
        "and the best", f"{current:.1f} us = {moe_bytes / current / 1e3:,.0f} GB/s; best {gu}: {t0:.1f} us = "
        f"{moe_bytes / t0 / 1e3:,.0f} GB/s")
    sweep2 = []
    for dbn in (4, 8, 16):
        for dbk in (256, 1024):
            timed_tiles(sweep2, experts_us, {**gu, "decode_down_block_n": dbn, "decode_down_block_k": dbk},
                        "MoE experts b=1")
    t1, tiles = min(sweep2, key=lambda r: r[0])
    row("MoE experts b=1, then the down tiles: best", f"{tiles}: {t1:.1f} us = {moe_bytes / t1 / 1e3:,.0f} GB/s")
    return [(f"TRITON_MOE_DECODE with the experts' best tiles {tiles}",
             dataclasses.replace(gemv, kernels=pre, kernel_params={**best, "moe": {**best["moe"], **tiles}}))]


def one_launch_sweep(eng, cfg, best):
    """The experts in one launch (routing, gate/up, down, sum) alone at batch 1 over their tiles, against the
    current split form (``experts_timer``). Returns the best tiles."""
    experts_us, moe_bytes = experts_timer(eng, cfg)
    current = experts_us(best["moe"])
    sweep = []
    for chunk in (16, 32, 48, 64):
        for bk in (256, 512):
            for warps in (4, 8):
                params = dict(decode_split_down=3, decode_chunk=chunk, decode_block_k=bk, decode_down_block_n=128,
                              decode_warps=warps, pdl=2)
                timed_tiles(sweep, experts_us, params, "MoE experts in one launch b=1")
    if not sweep:
        return None
    t0, tiles = min(sweep, key=lambda r: r[0])
    for dbn in (64, 256, 512):
        timed_tiles(sweep, experts_us, {**tiles, "decode_down_block_n": dbn}, "MoE experts in one launch b=1")
    t1, tiles = min(sweep, key=lambda r: r[0])
    row("MoE experts b=1 (75.5 MB): the current form (routing, gate/up, down + sum: three launches) and in one "
        "launch, the best tiles", f"{current:.1f} us = {moe_bytes / current / 1e3:,.0f} GB/s; one launch "
        f"{ {k: v for k, v in tiles.items() if k != 'pdl'} }: {t1:.1f} us = {moe_bytes / t1 / 1e3:,.0f} GB/s")
    for t_, p_ in sorted(sweep, key=lambda r: r[0])[:6]:
        row(f"  one launch {p_['decode_chunk']} rows, k {p_['decode_block_k']}, down n {p_['decode_down_block_n']}, "
            f"{p_['decode_warps']} warps", f"{t_:.1f} us")
    return {k: v for k, v in tiles.items() if k != "pdl"}


@section
def l2_survival() -> None:
    """Whether weights read into L2 ahead stay there while the experts stream through: a QKV-shaped GEMV (5,120 x
    2,048 bf16, 21 MB) timed from HBM (L2 flushed), right after the prefetch kernel read it, and after the
    prefetch and then 75 MB of other weights streamed by a GEMV with and without the "evict first" policy."""
    from kernels.linear_triton import linear_triton
    from kernels.prefetch_triton import prefetch_triton

    bf = torch.bfloat16
    w = torch.randn(5120, 2048, device="cuda", dtype=bf)
    other = torch.randn(18432, 2048, device="cuda", dtype=bf)
    x = torch.randn(1, 2048, device="cuda", dtype=bf)
    flush = torch.empty(512 * 2 ** 20, device="cuda", dtype=torch.uint8)
    tiles = dict(block_n=4, block_k=2048, num_warps=4)

    def us(prefetch: bool, stream_evict: int | None) -> float:
        times = []
        for _ in range(25):
            flush.zero_()
            if prefetch:
                prefetch_triton((w,), 1, "o_proj")()
            if stream_evict is not None:
                linear_triton(x, other, **tiles, evict=stream_evict)
            torch.cuda._sleep(200_000)  # ~0.1 ms: the GEMV is queued before the GPU reaches the start event
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            linear_triton(x, w, **tiles, evict=1)
            b.record()
            b.synchronize()
            times.append(1e3 * a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    cold, warm = us(False, None), us(True, None)
    after_first, after_normal = us(True, 1), us(True, 0)
    row("L2: QKV-shaped GEMV (21 MB) from HBM / after the prefetch / after the prefetch and 75 MB streamed "
        "evict-first / streamed with the default policy (median of 25, us)",
        f"{cold:.1f} / {warm:.1f} / {after_first:.1f} / {after_normal:.1f}")


@section
def experts_alone() -> None:
    """The experts alone at batch 1 (routing, gate/up with the activation, down with the sum), on synthetic
    Qwen3-30B-A3B-shaped expert weights of 24 layers (each call on another layer's, so none is served from L2),
    over the tiles; each tile's output first checked against the reference MoE."""
    from kernels.moe import moe_ref
    from kernels.moe_triton import make_moe

    bf = torch.bfloat16
    layers = [(torch.randn(128, 1536, 2048, device="cuda", dtype=bf) * 0.02,
               torch.randn(128, 2048, 768, device="cuda", dtype=bf) * 0.02) for _ in range(24)]
    x = torch.randn(1, 2048, device="cuda", dtype=bf)
    lgs = [torch.randn(1, 128, device="cuda", dtype=bf) for _ in layers]
    nbytes = 8 * 3 * 768 * 2048 * 2
    ref = moe_ref(x, lgs[0], *layers[0], 8, True).float()
    base = {"decode_split_down": 2, "decode_block_k": 2048, "decode_evict": 1, "decode_act": 1, "decode_warps": 4,
            "pdl": 2}
    sweep = []
    for bn in (1, 2, 4):
        for dbn in (8, 16, 32):
            for dbk in (256, 1024):
                params = {**base, "decode_block_n": bn, "decode_down_block_n": dbn, "decode_down_block_k": dbk}
                try:
                    op = make_moe(**params)
                    e = (op(x, lgs[0], *layers[0], 8, True).float() - ref).abs().max().item()
                    if e > 0.02 * ref.abs().max().item():
                        row(f"experts alone b=1 {params}", f"MISMATCH max abs err {e:.4f}")
                        continue
                    t = rotating_timed([lambda w=w, lg=lg: op(x, lg, *w, 8, True) for w, lg in zip(layers, lgs)])
                    sweep.append((t, bn, dbn, dbk))
                except Exception as ex:
                    row(f"experts alone b=1 {params}", f"FAILED {type(ex).__name__}: {str(ex)[:100]}")
    sweep.sort()
    current = next((r for r in sweep if r[1:] == (2, 16, 256)), None)
    row("experts alone b=1 (75.5 MB; checked against the reference), TRITON_MOE_DECODE's tiles (2 + 2 gate/up "
        "rows, down 16 x 256, 4 warps)", f"{1e6 * current[0]:.1f} us = {nbytes / current[0] / 1e9:,.0f} GB/s"
        if current else "n/a")
    for t, bn, dbn, dbk in sweep[:8]:
        row(f"  experts alone b=1: {bn} + {bn} gate/up rows, down {dbn} x {dbk}, 4 warps",
            f"{1e6 * t:.1f} us = {nbytes / t / 1e9:,.0f} GB/s")


# ---- 7. MoE -----------------------------------------------------------------------------------------
@section
def moe_decode(bw: float, layers: int | None, sweep_tiles: bool = False):
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.variant import VariantSpec

    attn = {"attention": {"num_splits": 0, "block_n": 32}}
    # the previous best form: the block after attention composed of its parts (norm, router GEMV, routing,
    # experts, sum: five launches)
    spec = VariantSpec(kernels={**TRITON_ALL, **TRITON_GEMV, "norm_moe": "reference"}, kernel_params=attn,
                       cuda_graph_batch_sizes=(1, 2, 4))
    t = time.perf_counter()
    eng = LLMEngine(EngineConfig(source=resolve("qwen3-30b-a3b"), device="cuda", dtype="bfloat16",
                                 num_kv_blocks=256, load_tokenizer=False, layers=layers, variant=spec))
    build = time.perf_counter() - t
    cfg = eng.model_config
    total = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in eng.model.named_parameters() if n.endswith(("w13", "w2")))
    embed = eng.model.embed_tokens.weight.numel() * 2
    active = total - experts - embed + experts * cfg.num_experts_per_tok // cfg.num_experts
    prompt, new = list(range(1, 129)), 128
    kv = cfg.kv_bytes_per_token(2) * (len(prompt) + new / 2)
    roofline = bw / (active + kv)
    row(f"MoE ({cfg.num_hidden_layers} layers) weights, active bytes per token",
        f"{total / 1e9:.1f} GB total, {active / 1e9:.2f} GB active (8 of 128 experts, lm_head; not the embedding "
        f"table); roofline {roofline:.0f} tok/s; engine build {build:.0f} s")
    # correctness on the GPU first: every form's greedy tokens against the eager reference MoE kernels
    ref_eng = LLMEngine.with_loaded(eng, dataclasses.replace(eng.config, variant=dataclasses.replace(
        spec, kernels={**TRITON_ALL, "moe": "reference"}, cuda_graph_batch_sizes=())))
    want = ref_eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    del ref_eng
    gemv = dataclasses.replace(spec, kernels={**TRITON_ALL, **TRITON_GEMV})
    best3 = moe_decode_params(attn["attention"], cfg.hidden_size)
    pre = TRITON_MOE_DECODE
    # TRITON_MOE_DECODE with changes (moe parameters, prefetch parameters, rotary_attention parameters)
    def moe_with(moe=None, prefetch=None, attention=None):
        return dataclasses.replace(gemv, kernels=pre, kernel_params={
            **best3, "moe": {**best3["moe"], **(moe or {})}, "prefetch": {**best3["prefetch"], **(prefetch or {})},
            "rotary_attention": {**best3["rotary_attention"], **(attention or {})}})

    forms = [
        ("TRITON_MOE_DECODE (the next QKV and o_proj into L2 during the attention, joined at the step's end; "
         "the activation in gate/up)", dataclasses.replace(gemv, kernels=pre, kernel_params=best3)),
        ("last session's TRITON_MOE_DECODE (o_proj's join before it, the activation in down)",
         moe_with({"decode_act": 0, "decode_block_n": 4}, {"defer_join": 0, "next_qkv": 0})),
        ("+ the activation in gate/up with 1 + 1 rows per program", moe_with({"decode_block_n": 1})),
    ]
    if sweep_tiles:  # the experts in one launch (measured slower than three launches: bench/RESULTS.md)
        one = one_launch_sweep(eng, cfg, best3)
        if one:
            forms.append(("+ the experts in one launch (routing, gate/up, down, sum)", dataclasses.replace(
                gemv, kernels=pre, kernel_params={**best3, "moe": {**one, "pdl": 2}})))
        forms += experts_sweep(eng, cfg, gemv, pre, best3)
    best = (0.0, None, "")
    for name, variant in forms:
        try:
            eng.apply_variant(variant)
            eng.block_manager.reset_prefix_cache()
            got = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
            agree = sum(a == b for a, b in zip(got, want))
            tps = max(decode_tps(eng, prompt, new, SamplingParams) for _ in range(3))
            graph, _ = eng.runner.graphs.graphs[1]
            replay = timed(graph.replay, iters=30)
        except Exception as e:  # report the form and go on with the next
            traceback.print_exc()
            row(f"MoE decode b=1 [{name}]", f"FAILED {type(e).__name__}: {str(e)[:160]}")
            continue
        row(f"MoE decode b=1 [{name}] (greedy vs eager reference MoE {agree}/8)",
            f"{tps:.1f} tok/s = {100 * tps / roofline:.1f}% of the active roofline; graph replay alone "
            f"{1 / replay:.1f} tok/s = {100 / replay / roofline:.1f}%")
        if agree == 8 and tps > best[0]:
            best = (tps, variant, name)
    row(f"MoE best decode b=1: [{best[2]}]", f"{best[0]:.1f} tok/s = {100 * best[0] / roofline:.1f}% of the "
        "active roofline")
    # where a step goes, kernel by kernel, in the best form without dependent launch (with it kernels overlap and
    # the profiler's per-kernel times add up to more than the step)
    if best[1] is not None:
        eng.apply_variant(dataclasses.replace(best[1], kernel_params=with_pdl(best[1].kernel_params, 0)))
        eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        kernel_profile("MoE, best form without dependent launch, graph replay", eng.runner.graphs.graphs[1][0].replay)
    del eng
    torch.cuda.empty_cache()


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--only", default="", help="comma-separated: attention,gemv,decode,throughput,swap,moe,experts")
    ap.add_argument("--trace", type=Path, default=ROOT / "bench" / "data" / "azure_conv_400.csv")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--decode-quick", action="store_true",
                    help="8B decode: only the five best forms, without the transformers rows")
    ap.add_argument("--moe-layers", type=int, default=None)
    ap.add_argument("--moe-sweep", action="store_true", help="MoE: also sweep the experts' tiles at batch 1")
    ap.add_argument("--cold-start", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_start:
        cold_start_child(args.cold_start, args.variant, args.t0)
        return
    OUT = args.out
    OUT.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    want = lambda s: not only or s in only  # noqa: E731
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    row("device", f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="polyinf_bench_"))
    ok = kernel_checks()
    ok2 = tiny_models_vs_transformers(tmp)
    bw, peak = machine() or (4.27e12, 700e12)
    if want("attention"):
        attention_bandwidth()
    if want("gemv") or want("decode"):
        gemv_bandwidth(bw)
    if want("decode") or want("moe"):
        l2_survival()
    if not (ok and ok2):
        row("model figures", "skipped: correctness checks failed")
    else:
        if want("decode") or want("throughput") or want("swap"):
            m = section(Llama8B)()
            if m is not None:
                best = llama8b_decode(m, bw, args.decode_quick) if want("decode") else None
                if best is None:
                    from engine.variant import VariantSpec
                    best = VariantSpec(kernels={**TRITON_ALL, **TRITON_GEMV}, kernel_params=BEST_ATTN,
                                       cuda_graph_batch_sizes=GRAPH_SIZES)
                if want("throughput"):
                    llama8b_throughput(m, args.trace, peak, args.requests, args.hf_batch)
                if want("swap"):
                    cold_start_and_swap(m, best, tmp)
                del m
                torch.cuda.empty_cache()
        if want("moe"):
            moe_decode(bw, args.moe_layers, args.moe_sweep)
        if want("experts"):
            experts_alone()
    finish()


def finish() -> None:
    """Prints every row as one table and writes them to OUT/LOG.json."""
    print("\n| what | figure |\n|---|---|")
    for n, v in ROWS:
        print(f"| {n} | {v} |")
    (OUT / f"{LOG}.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
