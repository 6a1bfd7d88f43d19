"""2. Machine figures, measured in this run: copy bandwidth and bf16 matmul throughput (the rooflines of the
sections after), decode attention bandwidth at 4k and 32k context against torch SDPA, the 8B decode
projections' matrix-vector kernels against cuBLAS, and whether weights read into L2 ahead survive the
experts streaming through."""
from __future__ import annotations

import torch

from bench.gpu.harness import DATASHEET_BF16, rotating_timed, row, section, timed


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
    from kernels.attention.attention import AttentionMetadata
    from kernels.attention.attention_triton import paged_attention_triton, split_kv_attention_triton

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


@section
def gemv_bandwidth(bw: float):
    """The 8B model's decode projections at batch 1: our matrix-vector kernels against cuBLAS."""
    import torch.nn.functional as F
    from kernels.linear import linear_triton as lt
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


@section
def l2_survival() -> None:
    """Whether weights read into L2 ahead stay there while the experts stream through: a QKV-shaped GEMV (5,120 x
    2,048 bf16, 21 MB) timed from HBM (L2 flushed), right after the prefetch kernel read it, and after the
    prefetch and then 75 MB of other weights streamed by a GEMV with and without the "evict first" policy."""
    from kernels.linear.linear_triton import linear_triton
    from kernels.attention.prefetch_triton import prefetch_triton

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
