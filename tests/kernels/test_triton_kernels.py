"""Every Triton kernel equals its plain-torch reference on fresh random inputs (TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import random

import pytest
import torch

from kernels.activation import silu_and_mul_ref
from kernels.activation_triton import silu_and_mul_triton
from kernels.attention import AttentionMetadata, paged_attention_ref
from kernels.attention_triton import paged_attention_triton, split_kv_attention_triton
from kernels.kv_store import store_kv_ref
from kernels.kv_store_triton import store_kv_triton
from kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton
from kernels.rotary import rotary_ref
from kernels.rotary_triton import rotary_triton

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 8), (7, 48), (5, 100), (3, 576)])
def test_rms_norms(shape):
    x, r = torch.randn(shape), torch.randn(shape)
    w = torch.randn(shape[-1])
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)
    out, summed = fused_add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_sum = fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(summed, ref_sum, **TOL)
    # q/k norm over heads of a strided view
    qkv = torch.randn(6, 3 * 40)
    q = qkv[:, :80].reshape(6, 2, 40)
    w2 = torch.randn(40)
    torch.testing.assert_close(rms_norm_triton(q, w2, 1e-6), rms_norm_ref(q, w2, 1e-6), **TOL)


@pytest.mark.parametrize("t,i", [(1, 8), (5, 72), (3, 1536), (2, 1100)])
def test_silu_and_mul(t, i):
    x = torch.randn(t, 2 * i)
    torch.testing.assert_close(silu_and_mul_triton(x, block=256), silu_and_mul_ref(x), **TOL)


@pytest.mark.parametrize("t,h,kvh,d", [(1, 4, 4, 8), (7, 9, 3, 64), (5, 6, 2, 40), (3, 12, 4, 24)])
def test_rotary(t, h, kvh, d):
    from engine.config import ModelConfig
    from engine.rope import rope_cos_sin

    cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=h * d, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=h, num_key_value_heads=kvh, head_dim=d)
    cs = rope_cos_sin(cfg, 300, "cpu")
    qkv = torch.randn(t, (h + 2 * kvh) * d)  # strided q/k views, as the model produces them
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    pos = torch.randint(0, 300, (t,))
    got, ref = rotary_triton(q, k, pos, cs), rotary_ref(q, k, pos, cs)  # k adjacent to q: one launch
    torch.testing.assert_close(got[0], ref[0], **TOL)
    torch.testing.assert_close(got[1], ref[1], **TOL)
    q2, k2 = torch.randn(t, h, d), torch.randn(t, kvh, d)  # separate tensors: one launch each
    got, ref = rotary_triton(q2, k2, pos, cs), rotary_ref(q2, k2, pos, cs)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    torch.testing.assert_close(got[1], ref[1], **TOL)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("t,h,kvh,d,bs", [(1, 4, 4, 8, 4), (7, 9, 3, 64, 16), (5, 6, 2, 40, 5)])
def test_rotary_store_kv(t, h, kvh, d, bs, norm):
    """rotary + KV store in one launch; with ``norm`` the q and k head norms too (Qwen3)."""
    import functools

    from engine.config import ModelConfig
    from engine.rope import rope_cos_sin
    from kernels.rotary import norm_rotary_store_kv_ref, rotary_store_kv_ref
    from kernels.rotary_triton import norm_rotary_store_kv_triton, rotary_store_kv_triton

    cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=h * d, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=h, num_key_value_heads=kvh, head_dim=d)
    cs = rope_cos_sin(cfg, 300, "cpu")
    qkv = torch.randn(t, (h + 2 * kvh) * d)  # strided q/k/v views of the fused projection
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    pos = torch.randint(0, 300, (t,))
    nb = 6
    slots = torch.randperm(nb * bs)[:t]
    kc, vc = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    caches = [kc.clone(), vc.clone(), kc.clone(), vc.clone()]
    if norm:
        qkv = qkv * 3.0  # heads far from unit RMS, so a missing norm shows
        q, k, v = (x.view(t, -1, d) for x in (qkv[:, : h * d], qkv[:, h * d : (h + kvh) * d], qkv[:, (h + kvh) * d :]))
        qw, kw = torch.rand(d) + 0.5, torch.rand(d) + 0.5
        fused = functools.partial(norm_rotary_store_kv_triton, q, k, v, qw, kw, 1e-6)
        plain = functools.partial(norm_rotary_store_kv_ref, q, k, v, qw, kw, 1e-6)
    else:
        fused = functools.partial(rotary_store_kv_triton, q, k, v)
        plain = functools.partial(rotary_store_kv_ref, q, k, v)
    got = fused(pos, cs, caches[0], caches[1], slots)
    ref = plain(pos, cs, caches[2], caches[3], slots)
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(caches[0], caches[2], **TOL)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)


@pytest.mark.parametrize("kvh,d,bs", [(1, 8, 4), (3, 64, 16), (2, 40, 5)])
def test_store_kv(kvh, d, bs):
    t, nb = 11, 9
    k = torch.randn(t, 3 * kvh, d)[:, :kvh]  # strided
    v = torch.randn(t, kvh, d)
    slots = torch.randperm(nb * bs)[:t]
    kc, vc = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    caches = [kc.clone(), vc.clone(), kc.clone(), vc.clone()]
    store_kv_triton(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)


def _paged_case(seed, heads, kvh, d, bs, specs):
    """specs: (context_len, new_tokens) per sequence; blocks scattered over the pool, last block partial."""
    rnd = random.Random(seed)
    nblocks = [-(-ctx // bs) for ctx, _ in specs]
    pool = list(range(sum(nblocks) + 3))
    rnd.shuffle(pool)
    k_cache = torch.randn(len(pool), bs, kvh, d)
    v_cache = torch.randn(len(pool), bs, kvh, d)
    tables, off = [], 0
    for n in nblocks:
        tables.append(pool[off : off + n] + [0] * (max(nblocks) - n))
        off += n
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, d)
    meta = AttentionMetadata.build(torch.zeros(qsl[-1], dtype=torch.int64), torch.tensor(tables, dtype=torch.int32),
                                   [c for c, _ in specs], qsl, "cpu")
    return q, k_cache, v_cache, meta


CASES = [
    # heads, kv heads, head dim, block size, [(context, new tokens)]
    (4, 4, 16, 4, [(1, 1), (9, 1), (13, 13)]),  # MHA, decode and a whole prefill
    (9, 3, 64, 16, [(37, 5), (16, 1), (70, 70)]),  # SmolLM2's GQA 3:1, chunked prefill
    (8, 2, 40, 5, [(23, 1), (6, 6), (41, 1), (11, 4)]),  # non-power-of-two head dim and block size
    (6, 1, 32, 8, [(100, 1)]),  # multi-query, a longer decode
]


@pytest.mark.parametrize("case", CASES)
def test_paged_attention(case):
    heads, kvh, d, bs, specs = case
    q, kc, vc, meta = _paged_case(len(specs) * 31 + d, heads, kvh, d, bs, specs)
    ref = paged_attention_ref(q, kc, vc, meta, d**-0.5)
    for block_m, block_n in ((16, 16), (32, 64)):
        got = paged_attention_triton(q, kc, vc, meta, d**-0.5, block_m=block_m, block_n=block_n)
        torch.testing.assert_close(got, ref, **TOL)
    # the same contexts as a pure decode batch: the decode kernel, whole and split
    last = [meta.query_start_loc[i + 1] - 1 for i in range(len(specs))]
    dq = q[last].contiguous()
    dmeta = AttentionMetadata.build(meta.slot_mapping[:len(last)], meta.block_tables, meta.context_lens,
                                    list(range(len(last) + 1)), "cpu")
    dref = paged_attention_ref(dq, kc, vc, dmeta, d**-0.5)
    torch.testing.assert_close(paged_attention_triton(dq, kc, vc, dmeta, d**-0.5, block_n=16), dref, **TOL)
    for splits in (1, 3, 0):  # 0: automatic
        got = split_kv_attention_triton(dq, kc, vc, dmeta, d**-0.5, num_splits=splits, block_n=16)
        torch.testing.assert_close(got, dref, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("t,h,e,k,i,renorm", [(1, 16, 4, 2, 8, True), (9, 40, 6, 2, 24, False),
                                               (33, 32, 8, 3, 20, True), (5, 24, 3, 3, 16, False)])
def test_moe_grouped_matmul(t, h, e, k, i, renorm):
    from kernels.moe import moe_ref
    from kernels.moe_triton import make_moe, moe_triton

    x, logits = torch.randn(t, h), torch.randn(t, e)
    w13, w2 = torch.randn(e, 2 * i, h) * 0.2, torch.randn(e, h, i) * 0.2
    ref = moe_ref(x, logits, w13, w2, k, renorm)
    grouped = moe_triton(x, logits, w13, w2, k, renorm, block_m=16, block_n=16, block_k=16, max_decode_pairs=0)
    torch.testing.assert_close(grouped, ref, rtol=1e-4, atol=1e-4)
    if t > 8:
        return  # the decode paths below take two tokens: the two smaller cases (k 2 and 3, renorm or not) cover them
    # the decode paths on a decode batch: up to two tokens (interpreted, every pair is a program)
    t = min(t, 2)
    x, logits = x[:t], logits[:t]
    ref = moe_ref(x, logits, w13, w2, k, renorm)
    # the device-only decode path (fused routing, per-pair matrix-vector kernels), partial blocks included
    pairs = moe_triton(x, logits, w13, w2, k, renorm, max_decode_pairs=t * k, decode_block_n=16, decode_block_k=16,
                       decode_down_block_n=8)
    torch.testing.assert_close(pairs, ref, rtol=1e-4, atol=1e-4)
    split = moe_triton(x, logits, w13, w2, k, renorm, max_decode_pairs=t * k, decode_block_n=16, decode_block_k=16,
                       decode_down_block_n=8, decode_split_down=1)
    torch.testing.assert_close(split, ref, rtol=1e-4, atol=1e-4)
    fused = moe_triton(x, logits, w13, w2, k, renorm, max_decode_pairs=t * k, decode_block_n=16, decode_block_k=16,
                       decode_down_block_n=8, decode_split_down=0)  # one down program row per token, over its k
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)
    # split per pair, summed by the last of each token's k programs (arrival counters the gate/up kernel zeroes;
    # the allocator hands the second call memory the first one left counted up)
    for _ in range(2):
        last = moe_triton(x, logits, w13, w2, k, renorm, max_decode_pairs=t * k, decode_block_n=16,
                          decode_block_k=16, decode_down_block_n=8, decode_split_down=2, pdl=1)
        torch.testing.assert_close(last, ref, rtol=1e-4, atol=1e-4)
    # the down kernel's expert and first weight chunk requested before its wait, the intermediate in several
    # chunks or one (its own chunk size)
    for block_k, down_block_k in ((16, 8), (32, 0), (16, 64)):
        early = moe_triton(x, logits, w13, w2, k, renorm, max_decode_pairs=t * k, decode_block_n=16,
                           decode_block_k=block_k, decode_down_block_n=8, decode_split_down=2, decode_down_early=1,
                           decode_down_block_k=down_block_k, decode_stages=1 + (block_k == 32), pdl=2)
        torch.testing.assert_close(early, ref, rtol=1e-4, atol=1e-4)
    # the routing by rank, the experts' weights read with the "evict first" policy (a hint: the same values),
    # with every down form
    for split in (0, 1, 2):
        ranked = moe_triton(x, logits, w13, w2, k, renorm, max_decode_pairs=t * k, decode_block_n=16,
                            decode_block_k=16, decode_down_block_n=8, decode_split_down=split, decode_route_rank=1,
                            decode_evict=1, pdl=2)
        torch.testing.assert_close(ranked, ref, rtol=1e-4, atol=1e-4)
    # the activation applied by the gate/up kernel (its programs read matching gate and up rows; a partial last
    # block of rows), with every down form
    for split in (0, 1, 2):
        act = moe_triton(x, logits, w13, w2, k, renorm, max_decode_pairs=t * k, decode_block_n=16,
                         decode_block_k=16, decode_down_block_n=8, decode_split_down=split, decode_act=1, pdl=2)
        torch.testing.assert_close(act, ref, rtol=1e-4, atol=1e-4)
    # routing, gate/up, down and the sum in one launch: chunks of the intermediate that do not divide it, one
    # that covers it whole, one row; the float32 sum and counter kept across calls (the kernel re-zeroes them)
    op = make_moe(max_decode_pairs=t * k, decode_split_down=3, decode_block_k=16, decode_down_block_n=8)
    for chunk in (6, 32, 1):
        for _ in range(2):
            one = op(x, logits, w13, w2, k, renorm, decode_chunk=chunk)
            torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4)
    scratch = op.keywords["scratch"]
    assert not scratch(t * h, x.device, torch.float32).any() and not scratch(1, x.device).any()


@pytest.mark.slow
@pytest.mark.parametrize("t,h,e,k,i,renorm", [(1, 48, 6, 2, 8, True), (3, 40, 9, 3, 24, False),
                                               (4, 32, 12, 4, 8, True), (6, 32, 8, 2, 16, True)])
def test_norm_moe(t, h, e, k, i, renorm):
    """The MoE block after attention: one launch for add + norm + router + routing (t <= 4), then the experts;
    larger batches through the Triton norm and the grouped path."""
    from kernels.moe import moe_ref, moe_route_ref, norm_moe_ref
    from kernels.counters import ArrivalCounters
    from kernels.moe_triton import norm_moe_triton
    from kernels.norm import fused_add_rms_norm_ref

    x, r, nw, gw = torch.randn(t, h), torch.randn(t, h), torch.randn(h), torch.randn(e, h) * 0.3
    w13, w2 = torch.randn(e, 2 * i, h) * 0.2, torch.randn(e, h, i) * 0.2
    ref, ref_summed = norm_moe_ref(x, r, nw, 1e-6, gw, w13, w2, k, renorm)
    hn, _ = fused_add_rms_norm_ref(x, r, nw, 1e-6)  # the reference is the composition it claims to be
    torch.testing.assert_close(ref, moe_ref(hn, hn @ gw.T, w13, w2, k, renorm))
    # the routing is not degenerate: the top k differ between tokens or the weights are not uniform
    assert moe_route_ref(hn @ gw.T, k, renorm)[0].std() > 0
    # router_block_k 32: the row in chunks (several passes); 64 >= h: the row in one chunk (one pass);
    # router_block_n 16 > e for the smaller cases: one program
    # route_by_last 0: the routing kernel after the norm + router launch
    counters = ArrivalCounters()
    # split 3: the experts in one launch that routes for itself (route_by_last has no effect); "rank": the
    # routing kernel after it by rank, the experts evict-first; "act": the activation applied by the gate/up kernel
    forms = ((1, 2, 32, 1, ""), (2, 4, 64, 1, ""), (0, 16, 32, 1, ""), (2, 4, 64, 0, ""), (2, 2, 32, 0, ""),
             (3, 4, 64, 1, ""), (2, 4, 64, 0, "rank"), (2, 4, 64, 1, "act"))
    decode = t <= 4  # more tokens take the Triton norm and the grouped experts, whatever the decode forms
    for n, (split, router_block_n, router_block_k, route_by_last, form) in enumerate(forms if decode else forms[:1]):
        # twice with each routing form: the routing's counter, kept by ``counters``, is reset by the kernel
        for _ in range(2 if n in (0, 3) and decode else 1):
            out, summed = norm_moe_triton(x, r, nw, 1e-6, gw, w13, w2, k, renorm, router_block_n=router_block_n,
                                          router_block_k=router_block_k, route_by_last=route_by_last,
                                          decode_block_n=16, decode_block_k=16, decode_down_block_n=8,
                                          decode_split_down=split, decode_route_rank=int(form == "rank"),
                                          decode_evict=int(form == "rank"), decode_act=int(form == "act"),
                                          pdl=1, block_m=16, block_n=16, block_k=16,
                                          counters=counters)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(summed, ref_summed)
    assert not counters(1, torch.device("cpu")).any() and not counters(t * h, torch.device("cpu"), torch.float32).any()
    with pytest.raises(TypeError, match="unknown parameters"):
        norm_moe_triton(x, r, nw, 1e-6, gw, w13, w2, k, renorm, decode_blok_n=8)


@pytest.mark.parametrize("t,e,k,renorm", [(1, 4, 2, True), (6, 128, 8, True), (3, 60, 3, False)])
def test_moe_route(t, e, k, renorm):
    from kernels.moe import moe_route_ref
    from kernels.moe_route_triton import moe_route_triton

    logits = torch.randn(t, e)
    logits[0, :2] = logits[0].max() + 1  # a tie at the top: the lower index first (a stable sort's order)
    rw, _ = moe_route_ref(logits, k, renorm)
    rids = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True).indices[:, :k]
    for rank in (0, 1):  # k serial reductions, or every expert's rank at once
        w, ids = moe_route_triton(logits, k, renorm, rank=rank)
        assert torch.equal(ids.long(), rids), rank
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m,n,k,bias,tiles", [
    (1, 40, 72, False, (4, 64, 4)),  # partial last tile in N and K
    (3, 100, 130, True, (8, 32, 4)),
    (4, 33, 576, False, (16, 128, 2)),
    (2, 64, 1000, True, (2, 512, 4)),
    (1, 24, 40, True, (8, 64, 4)),  # K within the first chunk (the one requested before the wait)
])
def test_linear_kernels(m, n, k, bias, tiles):
    from kernels.linear import act_linear_ref, linear_ref, norm_linear_ref
    from kernels.linear_triton import act_linear_triton, linear_triton, norm_linear_triton

    t = dict(zip(("block_n", "block_k", "num_warps"), tiles))
    x, r, w = torch.randn(m, k), torch.randn(m, k), torch.randn(n, k)
    b, nw = (torch.randn(n) if bias else None), torch.randn(k)
    tol = dict(rtol=1e-4, atol=1e-4)  # fp32 sums in another order
    torch.testing.assert_close(linear_triton(x, w, b, **t), linear_ref(x, w, b), **tol)
    # pdl=1 is accepted everywhere; on CPU it launches as usual (kernels/pdl.py)
    torch.testing.assert_close(linear_triton(x, w, b, **t, pdl=1), linear_ref(x, w, b), **tol)
    out, summed = norm_linear_triton(x, r, nw, 1e-6, w, b, **t)
    ref_out, ref_summed = norm_linear_ref(x, r, nw, 1e-6, w, b)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(summed, ref_summed)
    gu = torch.randn(m, 2 * k)
    torch.testing.assert_close(act_linear_triton(gu, w, **t), act_linear_ref(gu, w), **tol)
    # the weights read with the L2 "evict first" policy: a hint, the same values
    torch.testing.assert_close(linear_triton(x, w, b, **t, evict=1), linear_ref(x, w, b), **tol)
    torch.testing.assert_close(norm_linear_triton(x, r, nw, 1e-6, w, b, **t, evict=1)[0], ref_out, **tol)
    torch.testing.assert_close(act_linear_triton(gu, w, **t, evict=1), act_linear_ref(gu, w), **tol)
    # more rows than max_m: the plain matrix multiply after the Triton norm / activation
    x5, r5, gu5 = torch.randn(5, k), torch.randn(5, k), torch.randn(5, 2 * k)
    torch.testing.assert_close(linear_triton(x5, w, b, max_m=4), linear_ref(x5, w, b), **tol)
    torch.testing.assert_close(norm_linear_triton(x5, r5, nw, 1e-6, w, b, max_m=4)[0],
                               norm_linear_ref(x5, r5, nw, 1e-6, w, b)[0], **tol)
    torch.testing.assert_close(act_linear_triton(gu5, w, max_m=4), act_linear_ref(gu5, w), **tol)


@pytest.mark.parametrize("rstd_elements", [0, 64])
def test_norm_linear_statistics_in_chunks(monkeypatch, rstd_elements):
    """The norm prologue's row statistics in the weights' chunks (0) or in chunks smaller than the row (64
    elements: at least 64 columns per load, 6 loads for the row of 330)."""
    import kernels.linear_triton as lt
    from kernels.linear import norm_linear_ref

    monkeypatch.setattr(lt, "RSTD_ELEMENTS", rstd_elements)
    x, r, w, nw = torch.randn(3, 330), torch.randn(3, 330), torch.randn(20, 330), torch.randn(330)
    out, summed = lt.norm_linear_triton(x, r, nw, 1e-6, w, block_n=8, block_k=128, num_warps=4)
    ref_out, ref_summed = norm_linear_ref(x, r, nw, 1e-6, w)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(summed, ref_summed)


def test_dependent_launch_options():
    """pdl is 0, 1 or 2; off the GPU (and under the interpreter) kernels launch as usual."""
    from kernels.pdl import launch_options

    for level in (0, 1, 2):
        assert launch_options(level, torch.zeros(1)) == {"PDL": 0}
    with pytest.raises(ValueError, match="pdl must be"):
        launch_options(3, torch.zeros(1))


@pytest.mark.parametrize("n,programs,block", [(1000, 4, 64), (37, 8, 16), (4096, 3, 128)])
def test_l2_prefetch_reads_every_element(n, programs, block):
    """The prefetch kernel reads each weight once: its per-program sums add up to the tensor's (a program past
    the end reads nothing); on a CPU the side-stream form starts nothing."""
    from kernels.prefetch import no_join, prefetch_ref
    from kernels.prefetch_triton import prefetch_sums, prefetch_triton

    w = torch.randn(n, dtype=torch.float64).float()
    sums = prefetch_sums(w, programs=programs, block=block)
    torch.testing.assert_close(sums.double().sum(), w.double().sum(), rtol=1e-5, atol=1e-4)
    per = -(-(-(-n // programs)) // block) * block  # whole blocks per program
    want = torch.stack([w[p * per:(p + 1) * per].double().sum() for p in range(programs)])
    torch.testing.assert_close(sums.double(), want, rtol=1e-5, atol=1e-4)
    assert prefetch_triton((w,), 1) is no_join
    assert prefetch_triton((None,), 1, "next_qkv", next_qkv=1) is no_join  # the last layer has no next
    with pytest.raises(ValueError, match="unknown prefetch site"):
        prefetch_triton((w,), 1, "gate_up")
    # the step's last call joins the deferred reads (none here); the reference knows the same sites
    prefetch_triton((), 1, "end")()
    assert prefetch_ref((), 1, "end") is no_join and prefetch_ref((w,), 1, "next_qkv") is no_join
    with pytest.raises(ValueError, match="unknown prefetch site"):
        prefetch_ref((w,), 1, "gate_up")


class _Stream:
    """A stand-in CUDA stream that logs what is queued on it and what it waits for (no GPU here)."""

    def __init__(self, log, name):
        self.log, self.name, self.queued = log, name, 0

    def wait_stream(self, other):
        self.log.append((self.name, "waits for all of", other.name, other.queued))

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event.stream.name, event.queued))


class _Event:
    def record(self, stream):
        self.stream, self.queued = stream, stream.queued


class _Weight:
    """A weight that says it lives on a GPU (the prefetch reads nothing of it here: its launch is logged)."""
    is_cuda, device = True, torch.device("cpu")

    def __init__(self, name):
        self.name = name

    def is_contiguous(self):
        return True

    def view(self, *shape):
        return self


@pytest.fixture
def fake_streams(monkeypatch):
    """kernels.prefetch_triton's stream logic on a CPU: streams, events and the kernel's launch logged."""
    import contextlib
    import threading

    from kernels import prefetch_triton as pt

    log, current, made = [], threading.local(), []
    main = _Stream(log, "main")

    def stream(dev=None):
        s = _Stream(log, f"side{len(made)}")
        made.append(s)
        return s

    @contextlib.contextmanager
    def on(s):
        current.s = s
        yield
        current.s = None

    def launch(w, sink, programs, block, num_warps):
        current.s.queued += 1
        log.append((current.s.name, "reads", w.name))

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(pt, "_launch", launch)
    monkeypatch.setattr(pt, "_LOCAL", threading.local())
    return pt, log


def test_prefetch_joins_wait_for_their_own_reads_and_deferred_ones_at_the_end(fake_streams):
    """A join waits for its own site's reads only (not the next QKV's queued after them); deferred reads (the
    early next-QKV site, or every site with defer_join) are joined once by "end", forgotten by "abort"; each
    thread has its own side stream and its own deferred reads; batches over max_rows start nothing."""
    import threading

    from kernels.prefetch import no_join

    pt, log = fake_streams
    wo, wqkv = _Weight("o_proj"), _Weight("qkv")
    pre = pt.make_prefetch(next_qkv=2)
    join = pre((wo,), 1, "o_proj")
    assert pre((wqkv,), 1, "next_qkv_early") is no_join  # always deferred
    join()
    pre((), 1, "end")()
    pre((), 1, "end")()  # nothing left to join
    assert [e for e in log if e[0] == "main" and "waits" in e[1]] == [
        ("main", "waits for", "side0", 1),  # the output projection's read only: the next QKV's is queued second
        ("main", "waits for all of", "side0", 2)]
    assert ("side0", "reads", "o_proj") in log and ("side0", "reads", "qkv") in log

    log.clear()
    pre = pt.make_prefetch(defer_join=1)
    assert pre((wo,), 1, "o_proj") is no_join
    assert pre((wo,), 5, "o_proj") is no_join and pre((wqkv,), 1, "next_qkv") is no_join  # 5 > max_rows; off
    pre((), 1, "abort")()  # a step that raised: forgotten without a wait
    pre((), 1, "end")()
    assert [e[1] for e in log] == ["waits for all of", "reads"]  # the side stream's fork from main, one read

    log.clear()
    other = threading.Thread(target=lambda: pre((wo,), 1, "o_proj"))  # a variant warming up beside the engine
    other.start()
    other.join()
    pre((), 1, "end")()  # this thread deferred nothing: no wait
    assert log == [("side1", "waits for all of", "main", 0), ("side1", "reads", "o_proj")]  # its own side stream


def test_prefetch_params_are_checked_when_built():
    from kernels.prefetch_triton import make_prefetch

    make_prefetch(next_qkv=2, defer_join=1, programs=264)
    for bad, reason in (({"next_qkv": 3}, "next_qkv"), ({"o_proj": True}, "o_proj"), ({"programs": 0}, "programs"),
                        ({"block": 1000}, "powers of two")):
        with pytest.raises(ValueError, match=reason):
            make_prefetch(**bad)
    with pytest.raises(TypeError, match="unknown parameters defer"):
        make_prefetch(defer=1)


@pytest.mark.slow
def decode_block_case(heads, kvh, d, bs, contexts, norm, seed):
    """Inputs of a decode batch's attention block: strided q/k/v views of a fused projection, head-norm weights
    (or None), positions, the rotary table, a scattered paged cache and the metadata whose slots are each
    sequence's last position."""
    from engine.config import ModelConfig
    from engine.rope import rope_cos_sin

    cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=heads * d, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kvh, head_dim=d)
    cs = rope_cos_sin(cfg, 300, "cpu")
    _, kc, vc, meta = _paged_case(seed, heads, kvh, d, bs, [(c, 1) for c in contexts])
    t = len(contexts)
    # each sequence's new token goes to the slot of its last position
    slots = [int(meta.block_tables[i, (c - 1) // bs]) * bs + (c - 1) % bs for i, c in enumerate(contexts)]
    meta = AttentionMetadata.build(torch.tensor(slots), meta.block_tables, contexts, list(range(t + 1)), "cpu")
    qkv = torch.randn(t, (heads + 2 * kvh) * d)  # strided q/k/v views of the fused projection
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kvh) * d].view(t, kvh, d)
    v = qkv[:, (heads + kvh) * d :].view(t, kvh, d)
    qw, kw = (torch.randn(d), torch.randn(d)) if norm else (None, None)
    pos = torch.tensor([c - 1 for c in contexts])
    return q, k, v, qw, kw, pos, cs, kc, vc, meta


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("heads,kvh,d,bs,contexts", [
    (4, 4, 16, 4, [1, 9, 13]),  # MHA; a context of one token is only the new one
    (9, 3, 64, 16, [37, 16, 70]),  # GQA 3:1
    (8, 2, 40, 5, [23, 6, 41, 11]),  # head dim and block size not powers of two
    (6, 1, 32, 8, [100]),  # multi-query, a longer context
])
def test_rotary_attention(heads, kvh, d, bs, contexts, norm):
    """q/k head norms, rotary, KV store and decode attention with the splits merged by the last of them, in one
    launch, against the reference composed of its parts; prefill batches take the parts."""
    from kernels.attention import rotary_attention_ref
    from kernels.attention_triton import rotary_attention_triton
    from kernels.counters import ArrivalCounters

    q, k, v, qw, kw, pos, cs, kc, vc, meta = decode_block_case(heads, kvh, d, bs, contexts, norm, len(contexts) * 7 + d)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = rotary_attention_ref(q, k, v, qw, kw, 1e-6, pos, cs, ref_kc, ref_vc, meta, d**-0.5)
    counters = ArrivalCounters()
    # splits 0: automatic; by_last 0: the merge kernel after; early 0: the cache's first tile after the wait
    for splits, by_last, early in ((1, 1, 1), (3, 1, 1), (0, 1, 0), (3, 0, 1)):
        # where the last split merges, the counters are reset by the kernel: a second call must merge again (one
        # split, or the merge kernel after the splits, counts nothing)
        for _ in range(2 if by_last and splits != 1 else 1):
            got_kc, got_vc = kc.clone(), vc.clone()
            got = rotary_attention_triton(q, k, v, qw, kw, 1e-6, pos, cs, got_kc, got_vc, meta, d**-0.5,
                                          num_splits=splits, merge_by_last=by_last, block_n=8, counters=counters,
                                          cache_before_wait=early)
            torch.testing.assert_close(got, ref, **TOL)
            torch.testing.assert_close(got_kc, ref_kc, **TOL)
            torch.testing.assert_close(got_vc, ref_vc, rtol=0, atol=0)
    assert int(counters(1, torch.device("cpu")).abs().sum()) == 0
    # a prefill batch: the rotary + KV-store kernel, then the prefill kernel
    pq, pkc, pvc, pmeta = _paged_case(d, heads, kvh, d, bs, [(c, min(c, 3)) for c in contexts])
    n = pq.shape[0]
    pqkv = torch.randn(n, (heads + 2 * kvh) * d)
    parts = (pqkv[:, : heads * d].view(n, heads, d), pqkv[:, heads * d : (heads + kvh) * d].view(n, kvh, d),
             pqkv[:, (heads + kvh) * d :].view(n, kvh, d))
    ppos = torch.cat([torch.arange(c - min(c, 3), c) for c in contexts])
    pmeta.slot_mapping = torch.randperm(pkc.shape[0] * bs)[:n]
    a_kc, a_vc = pkc.clone(), pvc.clone()
    want = rotary_attention_ref(*parts, qw, kw, 1e-6, ppos, cs, pkc, pvc, pmeta, d**-0.5)
    got = rotary_attention_triton(*parts, qw, kw, 1e-6, ppos, cs, a_kc, a_vc, pmeta, d**-0.5, block_n=8)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(a_kc, pkc, **TOL)
