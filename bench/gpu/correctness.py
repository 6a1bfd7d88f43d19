"""1. Correctness on the GPU, before any figure: each Triton kernel against its plain-torch reference (bf16;
the MoE block after attention in fp32), and a tiny Llama and a tiny Qwen3-MoE through the engine (Triton
kernels, CUDA graphs, dependent launch, decode run ahead of the host) against transformers' greedy tokens
(fp32); a graph batch against each request alone. The model figures run only when these pass."""
from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch

from bench.gpu.harness import row, section
from engine.config.presets import preset_variant, with_pdl


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32; infinite when either holds a NaN or an infinity (a NaN would vanish in max())."""
    d = (a.float() - b.float()).abs()
    return d.max().item() if bool(torch.isfinite(d).all()) else float("inf")


@section
def kernel_checks() -> bool:
    from kernels.pointwise.activation import silu_and_mul_ref
    from kernels.pointwise.activation_triton import silu_and_mul_triton
    from kernels.attention.attention import AttentionMetadata, paged_attention_ref
    from kernels.attention.attention_triton import paged_attention_triton, split_kv_attention_triton
    from kernels.moe.moe import moe_ref
    from kernels.moe.moe_params import MoeParams, NormMoeParams
    from kernels.moe.moe_triton import moe_triton
    from kernels.pointwise.norm import fused_add_rms_norm_ref
    from kernels.pointwise.norm_triton import fused_add_rms_norm_triton
    from kernels.attention.rotary import rotary_store_kv_ref
    from kernels.attention.rotary_triton import rotary_store_kv_triton

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
    from engine.config.model_config import ModelConfig
    from engine.model.rope import rope_cos_sin

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
    from kernels.attention.attention import rotary_attention_ref
    from kernels.attention.attention_triton import rotary_attention_triton
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
    forms = (MoeParams(), MoeParams(max_decode_pairs=0),
             MoeParams(decode_split_down=2, decode_down_early=1, pdl=2),
             MoeParams(decode_split_down=2, decode_route_rank=1, decode_evict=1, pdl=2),
             MoeParams(decode_split_down=2, decode_evict=1, decode_act=1, decode_block_n=2, decode_block_k=2048,
                       decode_down_block_n=16, pdl=2))
    e_moe = max(err(moe_triton(xm, lg, w13, w2, 8, True, p_), mref) for p_ in forms)
    # the experts in one launch, twice with the kept float32 sum and counter (the kernel re-zeroes them)
    from kernels.moe.moe_triton import make_moe

    one = make_moe(decode_split_down=3, decode_chunk=48, decode_block_k=256, decode_down_block_n=128, pdl=2)
    for t_ in (1, 3, 3):
        e_moe = max(e_moe, err(one(xm[:t_], lg[:t_], w13, w2, 8, True), mref[:t_]))
    scale = mref.abs().max().item()
    # the MoE block after attention (norm + router + routing in one launch, sum by the last pair's program),
    # float32 so that no routing decision sits within rounding of a tie; with dependent launch
    from kernels.moe.moe import norm_moe_ref
    from kernels.moe.moe_triton import norm_moe_triton

    f32 = dict(device=dev, dtype=torch.float32)
    xs, rs, nws = torch.randn(3, 2048, **f32), torch.randn(3, 2048, **f32), torch.randn(2048, **f32)
    gws, w13s, w2s = torch.randn(128, 2048, **f32) * 0.02, w13.float(), w2.float()
    nref, nsum = norm_moe_ref(xs, rs, nws, 1e-6, gws, w13s, w2s, 8, True)
    e_nmoe = 0.0
    for t_ in (1, 3):
        for split, route_by_last, rank in ((1, 1, 0), (2, 1, 0), (2, 0, 0), (3, 1, 0), (2, 0, 1), (2, 0, 2)):
            params = NormMoeParams(decode_split_down=split, route_by_last=route_by_last,
                                   decode_route_rank=int(rank == 1), decode_evict=int(rank == 1),
                                   decode_act=int(rank == 2), pdl=1)
            o_, s_ = norm_moe_triton(xs[:t_], rs[:t_], nws, 1e-6, gws, w13s, w2s, 8, True, params)
            e_nmoe = max(e_nmoe, err(o_, nref[:t_]) / nref.abs().max().item(), err(s_, nsum[:t_]))
    del w13s, w2s
    # the L2 prefetch kernel reads every element once (its per-program sums add up)
    from kernels.attention.prefetch_triton import prefetch_sums

    wp = torch.randn(4096 * 4096 + 77, device=dev, dtype=bf)
    e_pf = abs(prefetch_sums(wp, programs=528, block=4096).double().sum().item() - wp.double().sum().item())
    e_nmoe = max(e_nmoe, e_pf / 1e3)  # reported with norm_moe; the sum of 16.8M bf16 values is ~1e3 in size
    # decode matrix-vector kernels (autotuned tiles), alone and with the norm / activation fused in; error
    # relative to the output's scale, since bf16 outputs of sums over 4096-14336 terms round at ~1e-2
    from kernels.linear.linear import act_linear_ref, linear_ref, norm_linear_ref
    from kernels.linear.linear_triton import act_linear_triton, linear_triton, norm_linear_triton

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
        # the presets' kernel tables at default tiles, and with dependent launch at tiles of the kernels' corners
        spec = preset_variant("gemv", kernel_params={})
        graphs = dataclasses.replace(spec, cuda_graph_batch_sizes=(1, 2, 4))
        pdl_params = with_pdl({"attention": {"num_splits": 0}, "rotary_attention": {"num_splits": 0},
                               "moe": {"decode_split_down": 2, "decode_down_early": 1}}, 2)
        pdl = preset_variant("moe-decode", base=graphs, kernel_params=pdl_params)
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
