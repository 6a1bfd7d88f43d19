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
    from kernels.attention import AttentionMetadata, paged_attention_ref
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
    meta = AttentionMetadata.build(torch.zeros(qsl[-1], dtype=torch.int64, device=dev), bt, ctx, qsl, dev)
    ref = paged_attention_ref(q, kc, vc, meta, d ** -0.5).float()
    e1 = (paged_attention_triton(q, kc, vc, meta, d ** -0.5).float() - ref).abs().max().item()
    last = [qsl[i + 1] - 1 for i in range(len(ctx))]
    dmeta = AttentionMetadata.build(meta.slot_mapping[:len(ctx)], bt, ctx, list(range(len(ctx) + 1)), dev)
    dq = q[last].contiguous()
    dref = paged_attention_ref(dq, kc, vc, dmeta, d ** -0.5).float()
    e2 = max((paged_attention_triton(dq, kc, vc, dmeta, d ** -0.5).float() - dref).abs().max().item(),
             (split_kv_attention_triton(dq, kc, vc, dmeta, d ** -0.5, num_splits=4).float() - dref).abs().max().item())
    ok = worst < 0.1 and worst_act < 0.1 and e1 < 0.02 and e2 < 0.02
    row("kernels vs reference (bf16 max abs err: norm/act/prefill/decode)",
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
    graphs = dataclasses.replace(spec, cuda_graph_batch_sizes=(1, 2, 4))
    compiled = VariantSpec(compile_mode="default")  # reference kernels: Inductor failed on our Triton prefill kernel
    for name, variant in (("reference", None), ("all-triton", spec), ("triton+graphs", graphs)):
        eng = LLMEngine(EngineConfig(source=resolve(str(tmp)), device="cuda", num_kv_blocks=64, variant=variant))
        results[name] = eng.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
        if name == "triton+graphs":  # a batch of 3 replays the padded 4-graph: each row equals its run alone
            batch = eng.generate([ids, ids[:20], ids[5:]], SamplingParams(max_tokens=8, ignore_eos=True))
            alone = [eng.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
                     for p in (ids, ids[:20], ids[5:])]
            results["graphs batch == alone"] = [b.token_ids for b in batch] == alone
    ok = all(v == want for k, v in results.items() if k != "graphs batch == alone") and results["graphs batch == alone"]
    try:  # torch.compile is optional: its result is reported, not required
        t = time.perf_counter()
        eng = LLMEngine(EngineConfig(source=resolve(str(tmp)), device="cuda", num_kv_blocks=64, variant=compiled))
        got = eng.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
        row("tiny Llama, reference kernels + compile_mode=default: greedy == transformers",
            f"{got == want} (engine build incl. compile {time.perf_counter() - t:.0f} s)")
    except Exception as e:
        row("tiny Llama, compile_mode=default FAILED", f"{type(e).__name__}: {str(e)[:160]}")
    row("tiny Llama fp32 on GPU: greedy == HF (ref, triton, graphs); graph batch == alone",
        ", ".join(str(v == want) if k != "graphs batch == alone" else str(v) for k, v in results.items())
        + f" -> {'OK' if ok else 'MISMATCH'}")
    return ok


def copy_bandwidth() -> float:
    n = 2 * 1024 ** 3
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), iters=20)
    bw = 2 * n / s
    row("copy bandwidth (read + write)", f"{bw / 1e9:,.0f} GB/s")
    a = b = None
    return bw


TRITON_ALL = {"rms_norm": "triton", "fused_add_rms_norm": "triton", "rotary": "triton", "silu_and_mul": "triton",
              "store_kv": "triton", "attention": "triton_paged"}


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
def llama8b(bw: float, tmp: Path):
    import transformers as tf
    from engine import EngineConfig, LLMEngine, SamplingParams, resolve
    from engine.llm_engine import LoadedModel
    from engine.loader import PRESETS_DIR
    from engine.variant import VariantSpec
    from engine.weights import assemble

    raw = json.loads((PRESETS_DIR / "llama-3.1-8b.json").read_text())
    hf_cfg = tf.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = tf.LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p_ in hf.parameters():  # transformers initialises norms to 1; spread them as trained ones are
            if p_.dim() == 1:
                p_.add_(torch.randn_like(p_) * 0.05)
    source = resolve("llama-3.1-8b")
    cfg = EngineConfig(source=source, device="cuda", dtype="bfloat16", num_kv_blocks=512, load_tokenizer=False)
    from engine.config import ModelConfig

    mcfg = ModelConfig.from_hf_dict(raw)
    t0 = time.perf_counter()
    ours_model = assemble(mcfg, hf.state_dict().items(), torch.device("cuda"), torch.bfloat16)
    eng = LLMEngine(cfg, LoadedModel(mcfg, ours_model, None, time.perf_counter() - t0))
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    prompt = list(range(1, 129))
    new = 128
    roofline = bw / (weight_bytes + eng.model_config.kv_bytes_per_token(2) * (len(prompt) + new / 2))
    row("8B roofline, batch-1 decode (copy bw / weight+KV bytes per token)", f"{roofline:.1f} tok/s")

    # correctness on the GPU before any figure: greedy tokens against transformers on the same weights
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                           cache_implementation="static")[0, len(prompt):].tolist()
    base = eng.variant
    specs = {
        "reference": base,
        "triton kernels": dataclasses.replace(base, kernels=TRITON_ALL),
        "triton + CUDA graphs": dataclasses.replace(base, kernels=TRITON_ALL, cuda_graph_batch_sizes=(1, 2, 4, 8)),
        "triton split-KV(4) + CUDA graphs": dataclasses.replace(
            base, kernels={**TRITON_ALL, "attention": "triton_split_kv"}, kernel_params={"attention": {"num_splits": 4}},
            cuda_graph_batch_sizes=(1, 2, 4, 8)),
    }
    for block_n, warps in ((64, 4), (128, 4), (128, 8)):
        specs[f"triton + graphs, attention block_n={block_n} warps={warps}"] = dataclasses.replace(
            base, kernels=TRITON_ALL, kernel_params={"attention": {"block_n": block_n, "num_warps": warps}},
            cuda_graph_batch_sizes=(1, 2, 4, 8))
    best = 0.0
    for name, spec in specs.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.apply_variant(spec)
        eng.generate([prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
        torch.cuda.synchronize()
        swap = time.perf_counter() - t
        got = eng.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
        agree = sum(a == b for a, b in zip(got, want))
        tps = decode_tps(eng, prompt, new, SamplingParams)
        if tps > best:
            best, best_spec = tps, spec
        row(f"8B decode b=1 [{name}]", f"{tps:.1f} tok/s = {100 * tps / roofline:.0f}% roofline; "
            f"greedy agree w/ HF {agree}/16; swap+warm {swap:.2f} s")
        if eng.runner.graphs is not None:  # the GPU's share: the captured step replayed back to back
            graph, _ = eng.runner.graphs.graphs[1]
            replay = timed(graph.replay, iters=50)
            row(f"8B decode b=1 [{name}] graph replay alone",
                f"{1 / replay:.1f} tok/s = {100 / replay / roofline:.0f}% roofline (host overhead "
                f"{1e3 * (1 / tps - replay):.2f} ms/token)")
    # transformers with a static cache: eager, and with its automatic torch.compile (warmed by a full run first)
    hf_rates = {}
    for label, extra in (("eager", {"disable_compile": True}), ("auto-compiled", {})):
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                  cache_implementation="static", **extra)
        with torch.no_grad():
            t = time.perf_counter()
            hf.generate(ids, **kw)  # warm-up (compiles, for the second)
            torch.cuda.synchronize()
            warm = time.perf_counter() - t
            t = time.perf_counter()
            hf.generate(ids, **kw)
            torch.cuda.synchronize()
            hf_rates[label] = new / (time.perf_counter() - t)
        row(f"8B transformers generate, static cache, {label}, b=1 (incl. prefill)",
            f"{hf_rates[label]:.1f} tok/s = {100 * hf_rates[label] / roofline:.0f}% roofline (warm-up {warm:.0f} s)")
    hf_tps = max(hf_rates.values())
    row("8B best decode / transformers static", f"{best / hf_tps:.2f}x")

    # cold start from disk: safetensors written here, then load + build + capture + warm up, vs a forward swap
    del hf
    torch.cuda.empty_cache()
    folder = tmp / "llama8b"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        from safetensors.torch import save_file

        sd = {}
        for name, t_ in ours_model.state_dict().items():
            sd[name] = t_
        (folder / "config.json").write_text(json.dumps(raw))
        hf_names = _engine_to_hf(ours_model, mcfg)
        save_file({k: v.contiguous() for k, v in hf_names.items()}, str(folder / "model.safetensors"))
        del sd, hf_names
        torch.cuda.empty_cache()
        spec = best_spec
        t0 = time.perf_counter()
        cold = LLMEngine(EngineConfig(source=resolve(str(folder)), device="cuda", dtype="bfloat16", num_kv_blocks=512,
                                      load_tokenizer=False, variant=spec))
        cold.generate([prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
        torch.cuda.synchronize()
        cold_s = time.perf_counter() - t0
        fresh = list(range(200, 328))  # a prompt neither engine has cached
        same = cold.generate([fresh], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
        eng.apply_variant(spec)
        got = eng.generate([fresh], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
        other = dataclasses.replace(spec, kernels={**TRITON_ALL, "attention": "triton_split_kv"},
                                    kernel_params={"attention": {"num_splits": 2}})
        torch.cuda.synchronize()
        t = time.perf_counter()
        cold.apply_variant(other)
        cold.generate([prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
        torch.cuda.synchronize()
        swap = time.perf_counter() - t
        row("8B cold start from safetensors on local disk (load+build+graphs+warm-up)",
            f"{cold_s:.1f} s (weights {cold.load_seconds:.1f} s)")
        row("8B forward hot swap (new attention kernel, recapture graphs, warm-up)",
            f"{swap:.2f} s = {100 * swap / cold_s:.2f}% of cold start")
        row("8B loaded-from-disk greedy == in-memory engine", str(same == got))
    finally:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)


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
def attention_bandwidth():
    from kernels.attention import AttentionMetadata
    from kernels.attention_triton import paged_attention_triton, split_kv_attention_triton
    import torch.nn.functional as F

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
        res = {}
        res["paged"] = timed(lambda: paged_attention_triton(q, kc, vc, meta, d ** -0.5, block_n=64))
        for s in (8, 32):
            res[f"split{s}"] = timed(lambda: split_kv_attention_triton(q, kc, vc, meta, d ** -0.5,
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
    tmp = Path("/tmp/polyinf_bench/tiny_llama")
    tmp.mkdir(parents=True, exist_ok=True)
    ok2 = tiny_llama_vs_transformers(tmp)
    bw = copy_bandwidth()
    attention_bandwidth()
    if ok and ok2:
        llama8b(bw, Path("/tmp/polyinf_bench"))
    else:
        row("8B figures", "skipped: correctness checks failed")
    print("\n| what | figure |\n|---|---|")
    for n, v in ROWS:
        print(f"| {n} | {v} |")
    (args.out / "gpu_bench.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
