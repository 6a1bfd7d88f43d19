"""GPU benchmark in one script: correctness first, then figures, then one table.

    python bench/gpu_bench.py [--out DIR]

1. Correctness on the GPU: each Triton kernel against its plain-torch reference; a tiny
   Llama through the engine (all-Triton variant) against transformers' logits/greedy tokens.
2. Copy bandwidth (device-to-device, bytes read + written) measured in this run.
3. Llama-3.1-8B-shaped synthetic model, bf16: cold start; batch-1 decode tokens/s for the
   reference variant and Triton variants, as a fraction of the roofline (weights + KV bytes
   per token over the measured copy bandwidth); transformers generate with a static cache on
   the same weights; a forward hot swap against the cold start.
4. Decode attention at 4k and 32k context: achieved bandwidth of our kernels and torch SDPA.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
import traceback
from pathlib import Path

import torch

ROWS: list[tuple[str, str]] = []


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"{name:64} {value}", flush=True)


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


def section(fn):
    def run(*a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:  # keep going: every section reports on its own
            traceback.print_exc()
            row(f"{fn.__name__} FAILED", f"{type(e).__name__}: {str(e)[:120]}")
    return run


def kernel_checks():
    from kernels.attention import paged_attention_ref
    from kernels.attention_triton import paged_attention_triton, split_kv_attention_triton
    from kernels.norm import fused_add_rms_norm_ref
    from kernels.norm_triton import fused_add_rms_norm_triton
    from kernels.activation import silu_and_mul_ref
    from kernels.activation_triton import silu_and_mul_triton

    dev = "cuda"
    worst = 0.0
    x = torch.randn(7, 4096, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    a, b = fused_add_rms_norm_triton(x, r, w, 1e-5), fused_add_rms_norm_ref(x, r, w, 1e-5)
    worst = max(worst, (a[0].float() - b[0].float()).abs().max().item())
    g = torch.randn(5, 2 * 14336, device=dev, dtype=torch.bfloat16)
    worst_act = (silu_and_mul_triton(g).float() - silu_and_mul_ref(g).float()).abs().max().item()
    heads, kvh, d, bs = 32, 8, 128, 16
    ctx = [1, 17, 300, 1000]
    nb = [-(-c // bs) for c in ctx]
    kc = torch.randn(sum(nb) + 2, bs, kvh, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(sum(nb) + 2).tolist()
    tables, off = [], 0
    for n in nb:
        tables.append(perm[off:off + n] + [0] * (max(nb) - n))
        off += n
    bt = torch.tensor(tables, dtype=torch.int32, device=dev)
    news = [1, 17, 1, 5]
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, d, device=dev, dtype=torch.bfloat16)
    ref = paged_attention_ref(q, kc, vc, bt, ctx, qsl, d ** -0.5).float()
    e1 = (paged_attention_triton(q, kc, vc, bt, ctx, qsl, d ** -0.5).float() - ref).abs().max().item()
    e2 = (split_kv_attention_triton(q, kc, vc, bt, ctx, qsl, d ** -0.5, num_splits=4).float() - ref).abs().max().item()
    ok = worst < 0.1 and worst_act < 0.1 and e1 < 0.02 and e2 < 0.02
    row("kernels vs reference (bf16 max abs err: norm/act/paged/split)",
        f"{worst:.3g} / {worst_act:.3g} / {e1:.3g} / {e2:.3g} -> {'OK' if ok else 'MISMATCH'}")
    return ok


@section
def tiny_llama_vs_transformers(tmp: Path):
    import transformers as tf
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.variant import VariantSpec

    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp)
    hf = hf.cuda()
    ids = torch.randint(0, 1000, (40,)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    spec = VariantSpec(kernels={"rms_norm": "triton", "fused_add_rms_norm": "triton", "rotary": "triton",
                                "silu_and_mul": "triton", "store_kv": "triton", "attention": "triton_paged"})
    results = {}
    for name, variant in (("reference", None), ("all-triton", spec)):
        eng = LLMEngine(EngineConfig(source=resolve(str(tmp)), device="cuda", num_kv_blocks=64, variant=variant))
        results[name] = eng.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    ok = all(v == want for v in results.values())
    row("tiny Llama fp32 on GPU: greedy tokens == transformers (ref, triton)",
        f"{results['reference'] == want}, {results['all-triton'] == want} -> {'OK' if ok else 'MISMATCH'}")
    return ok


def copy_bandwidth() -> float:
    n = 2 * 1024 ** 3
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), iters=20)
    bw = 2 * n / s
    row("copy bandwidth (read + write)", f"{bw / 1e9:,.0f} GB/s")
    del a, b
    return bw


@section
def llama8b(bw: float):
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.variant import VariantSpec

    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(source=resolve("llama-3.1-8b"), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                 load_tokenizer=False))
    eng.generate([list(range(1, 9))], SamplingParams(max_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    cold = time.perf_counter() - t0
    row("8B cold start (synthesize weights on GPU + build + warm-up)", f"{cold:.1f} s")
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    prompt = list(range(1, 129))
    new = 128
    kv_per_tok = eng.model_config.kv_bytes_per_token(2)
    avg_ctx = len(prompt) + new / 2
    roofline = bw / (weight_bytes + kv_per_tok * avg_ctx)
    row("8B roofline, batch-1 decode (copy bw / bytes per token)", f"{roofline:.1f} tok/s")
    base = eng.variant
    variants = {
        "reference": base,
        "triton norms+act+rope+store, paged attn": dataclasses.replace(base, kernels={
            "rms_norm": "triton", "fused_add_rms_norm": "triton", "rotary": "triton", "silu_and_mul": "triton",
            "store_kv": "triton", "attention": "triton_paged"}),
        "triton ..., split-KV attn (4 splits)": dataclasses.replace(base, kernels={
            "rms_norm": "triton", "fused_add_rms_norm": "triton", "rotary": "triton", "silu_and_mul": "triton",
            "store_kv": "triton", "attention": "triton_split_kv"}, kernel_params={"attention": {"num_splits": 4}}),
    }
    best = 0.0
    for name, spec in variants.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.apply_variant(spec)
        eng.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
        torch.cuda.synchronize()
        swap = time.perf_counter() - t
        eng.add_request(prompt, SamplingParams(max_tokens=new, ignore_eos=True))
        eng.step()  # prefill
        torch.cuda.synchronize()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        torch.cuda.synchronize()
        tps = (new - 1) / (time.perf_counter() - t)
        best = max(best, tps)
        row(f"8B decode b=1 [{name}]", f"{tps:.1f} tok/s = {100 * tps / roofline:.0f}% roofline; swap {swap:.2f} s "
            f"({100 * swap / cold:.2f}% of cold)")
    # transformers with a static cache on the same weights
    import transformers as tf
    from engine.config import ModelConfig
    from engine.loader import PRESETS_DIR

    hf_cfg = tf.LlamaConfig(**{k: v for k, v in json.loads((PRESETS_DIR / "llama-3.1-8b.json").read_text()).items()
                               if k not in ("architectures",)})
    with torch.device("meta"):
        hf = tf.LlamaForCausalLM(hf_cfg)
    sd = {}
    m = eng.model
    q, kv = 32 * 128, 8 * 128
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        w = layer.self_attn.qkv_proj.weight
        sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"] = (
            w[:q], w[q:q + kv], w[q + kv:])
        sd[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
        gu = layer.mlp.gate_up_proj.weight
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gu[:14336], gu[14336:]
        sd[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        sd[p + "input_layernorm.weight"] = layer.input_layernorm
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
    sd["model.embed_tokens.weight"] = m.embed_tokens.weight
    sd["model.norm.weight"] = m.norm
    sd["lm_head.weight"] = m.lm_head
    hf.load_state_dict(sd, assign=True, strict=False)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg, device="cuda")
    hf = hf.eval()
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                    cache_implementation="static")
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0, cache_implementation="static")
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - t
    hf_tps = new / hf_s
    row("8B transformers generate, static cache, b=1 (incl. prefill)",
        f"{hf_tps:.1f} tok/s = {100 * hf_tps / roofline:.0f}% roofline")
    ours = LLMEngine.with_loaded(eng, eng.config)
    ours.apply_variant(base)
    same = ours.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    row("8B greedy tokens: ours (reference) == transformers, first 16", str(same == out[0, len(prompt):len(prompt) + 16].tolist()))
    row("8B best decode / transformers static", f"{best / hf_tps:.2f}x")


@section
def attention_bandwidth():
    from kernels.attention_triton import paged_attention_triton, split_kv_attention_triton
    import torch.nn.functional as F

    heads, kvh, d, bs, batch = 32, 8, 128, 16, 8
    for ctx in (4096, 32768):
        nb = ctx // bs
        kc = torch.randn(batch * nb, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.arange(batch * nb, dtype=torch.int32, device="cuda").view(batch, nb)
        q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
        ctxs, qsl = [ctx] * batch, list(range(batch + 1))
        nbytes = 2 * batch * ctx * kvh * d * 2
        res = {}
        res["paged"] = timed(lambda: paged_attention_triton(q, kc, vc, bt, ctxs, qsl, d ** -0.5, block_n=64))
        for s in (8, 32):
            res[f"split{s}"] = timed(lambda: split_kv_attention_triton(q, kc, vc, bt, ctxs, qsl, d ** -0.5,
                                                                         num_splits=s, block_n=64))
        k = kc.view(batch, ctx, kvh, d).transpose(1, 2)
        v = vc.view(batch, ctx, kvh, d).transpose(1, 2)
        qq = q.view(batch, heads, 1, d)
        res["sdpa"] = timed(lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True))
        row(f"decode attention {ctx // 1024}k ctx, batch {batch}: GB/s",
            ", ".join(f"{n} {nbytes / s / 1e9:,.0f}" for n, s in res.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    row("device", f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    ok = section(kernel_checks)()
    tmp = args.out / "tiny_llama"
    tmp.mkdir(parents=True, exist_ok=True)
    ok2 = tiny_llama_vs_transformers(tmp)
    bw = copy_bandwidth()
    attention_bandwidth()
    if ok and ok2:
        llama8b(bw)
    else:
        row("8B figures", "skipped: correctness checks failed")
    print("\n| what | figure |\n|---|---|")
    for n, v in ROWS:
        print(f"| {n} | {v} |")
    (args.out / "gpu_bench.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
