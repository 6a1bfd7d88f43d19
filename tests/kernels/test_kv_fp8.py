"""An FP8 (e4m3) KV cache: the Triton store and attention kernels against their references over the same cache,
and the references against attention over the cache's values widened to float64 (TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.attention import AttentionMetadata, paged_attention_ref
from kernels.attention.attention_triton import paged_attention_triton, split_kv_attention_triton
from kernels.attention.kv_store import store_kv_ref
from kernels.attention.kv_store_triton import store_kv_triton
from tests.kernels.test_triton_kernels import _paged_case, decode_block_case

FP8 = torch.float8_e4m3fn
TOL = dict(rtol=1e-4, atol=1e-4)


def _hard_values(n: int) -> torch.Tensor:
    """Values that test e4m3 rounding: every e4m3 value and the midpoints between neighbours (ties to even),
    values just under a binade (the carry into the next), subnormals, and random ones over the whole range."""
    every = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    every = every[torch.isfinite(every)].sort().values
    mids = (every[1:] + every[:-1]) / 2
    pool = torch.cat([every, mids, every * 0.999, torch.randn(512) * 50, torch.randn(128) * 0.01])
    return pool[torch.randint(len(pool), (n,))]


def test_store_into_fp8_rounds_to_nearest_even_and_saturates():
    kvh, d, bs, nb, t = 2, 16, 4, 6, 9
    k, v = _hard_values(t * kvh * d).view(t, kvh, d), _hard_values(t * kvh * d).view(t, kvh, d)
    k[0, 0, :4] = torch.tensor([500.0, -1e4, 449.0, -448.0])  # beyond the range: saturated at +-448
    slots = torch.randperm(nb * bs)[:t]
    a = [torch.zeros(nb, bs, kvh, d, dtype=FP8) for _ in range(2)]
    b = [torch.zeros(nb, bs, kvh, d, dtype=FP8) for _ in range(2)]
    store_kv_triton(k, v, a[0], a[1], slots)
    store_kv_ref(k, v, b[0], b[1], slots)
    for got, want in zip(a, b):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    stored = b[0].view(-1, kvh, d)[slots].float()
    assert stored[0, 0, :4].tolist() == [448.0, -448.0, 448.0, -448.0]
    # torch's conversion (the reference) rounds to nearest even: within half a step of 1/8 of the value
    small = k.abs() < 448
    assert ((stored - k).abs()[small] <= k.abs()[small] / 16 + 2.0 ** -10).all()


@pytest.mark.parametrize("case", [
    (9, 3, 64, 16, [(37, 5), (16, 1), (70, 70)]),  # SmolLM2's GQA 3:1, chunked prefill
    (8, 2, 40, 5, [(23, 1), (6, 6), (41, 1)]),  # head dim and block size not powers of two
])
def test_attention_over_an_fp8_cache(case):
    heads, kvh, d, bs, specs = case
    q, kc, vc, meta = _paged_case(len(specs) * 13 + d, heads, kvh, d, bs, specs)
    kc8, vc8 = kc.to(FP8), vc.to(FP8)
    ref = paged_attention_ref(q, kc8, vc8, meta, d**-0.5)
    # the reference reads the cache's values exactly: the same as attention over them widened beforehand
    torch.testing.assert_close(ref, paged_attention_ref(q, kc8.float(), vc8.float(), meta, d**-0.5), rtol=0, atol=0)
    torch.testing.assert_close(paged_attention_triton(q, kc8, vc8, meta, d**-0.5, block_m=16, block_n=16), ref, **TOL)
    last = [meta.query_start_loc[i + 1] - 1 for i in range(len(specs))]
    dq = q[last].contiguous()
    dmeta = AttentionMetadata.build(meta.slot_mapping[:len(last)], meta.block_tables, meta.context_lens,
                                    list(range(len(last) + 1)), "cpu")
    dref = paged_attention_ref(dq, kc8, vc8, dmeta, d**-0.5)
    for splits in (1, 3):
        got = split_kv_attention_triton(dq, kc8, vc8, dmeta, d**-0.5, num_splits=splits, block_n=16)
        torch.testing.assert_close(got, dref, **TOL)


@pytest.mark.parametrize("norm", [False, True])
def test_fused_attention_block_over_an_fp8_cache(norm):
    """Rotary, KV store and split-KV decode attention in one launch: the new token attends to its key and value
    as the cache holds them (rounded to e4m3), as the reference, which stores and then reads, does."""
    from kernels.attention.attention import rotary_attention_ref
    from kernels.attention.attention_triton import rotary_attention_triton

    heads, kvh, d, bs, contexts = 9, 3, 64, 16, [37, 16, 70]
    q, k, v, qw, kw, pos, cs, kc, vc, meta = decode_block_case(heads, kvh, d, bs, contexts, norm, d + 5)
    kc, vc = kc.to(FP8), vc.to(FP8)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = rotary_attention_ref(q, k, v, qw, kw, 1e-6, pos, cs, ref_kc, ref_vc, meta, d**-0.5)
    for splits in (1, 3):
        got_kc, got_vc = kc.clone(), vc.clone()
        got = rotary_attention_triton(q, k, v, qw, kw, 1e-6, pos, cs, got_kc, got_vc, meta, d**-0.5,
                                      num_splits=splits, block_n=8)
        torch.testing.assert_close(got, ref, **TOL)
        # the same bytes cached, but for a rounding tie the fused rotary may break the other way
        assert (got_kc.float() - ref_kc.float()).abs().max() <= ref_kc.float().abs().max() / 8
        assert torch.equal(got_vc.view(torch.uint8), ref_vc.view(torch.uint8))


def test_fused_attention_block_over_an_fp8_cache_widened_to_float16():
    """The fused block with bfloat16 inputs and ``fp8_f16``: the rotated query heads narrowed to float16 and the
    e4m3 tiles widened to it, against the reference in float32 over the same (bfloat16) inputs; the cache's bytes
    as the reference stores them. With float32 inputs the flag changes nothing. (The norm weights stay float32:
    Triton's interpreter reads bfloat16 ones wrongly.)"""
    from kernels.attention.attention import rotary_attention_ref
    from kernels.attention.attention_triton import rotary_attention_triton

    heads, kvh, d, bs, contexts = 8, 2, 64, 16, [37, 16, 70]
    q, k, v, qw, kw, pos, cs, kc, vc, meta = decode_block_case(heads, kvh, d, bs, contexts, True, d + 7)
    kc, vc = kc.to(FP8), vc.to(FP8)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = rotary_attention_ref(qb.float(), kb.float(), vb.float(), qw, kw, 1e-6, pos, cs, ref_kc, ref_vc, meta,
                               d**-0.5)
    for splits in (1, 3):
        got_kc, got_vc = kc.clone(), vc.clone()
        got = rotary_attention_triton(qb, kb, vb, qw, kw, 1e-6, pos, cs, got_kc, got_vc, meta, d**-0.5,
                                      num_splits=splits, block_n=8, fp8_f16=1)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)  # bf16 rotation, f16 products
        assert torch.equal(got_vc.view(torch.uint8), ref_vc.view(torch.uint8))
        plain = rotary_attention_triton(q, k, v, qw, kw, 1e-6, pos, cs, kc.clone(), vc.clone(), meta, d**-0.5,
                                        num_splits=splits, block_n=8, fp8_f16=1)
        torch.testing.assert_close(plain, rotary_attention_ref(q, k, v, qw, kw, 1e-6, pos, cs, kc.clone(), vc.clone(),
                                                               meta, d**-0.5), **TOL)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_over_an_fp8_cache_widened_to_float16(splits):
    """bfloat16 queries over an e4m3 cache with the tiles widened to float16 (``fp8_f16``): against attention in
    float64 over the same queries and cached values, within bfloat16 output rounding. (Widened to bfloat16, the
    default, is checked on a GPU by bench/gpu/precision/prefill.py: Triton's interpreter converts e4m3 to
    bfloat16 wrongly, e4m3 to float16 and float32 rightly.)"""
    heads, kvh, d, bs, specs = 8, 2, 64, 16, [(37, 1), (70, 1), (5, 1)]
    q, kc, vc, meta = _paged_case(len(specs) * 13 + d, heads, kvh, d, bs, specs)
    kc8, vc8 = kc.to(FP8), vc.to(FP8)
    qb = q.to(torch.bfloat16)
    want = paged_attention_ref(qb.double(), kc8.double(), vc8.double(), meta, d**-0.5)
    got = paged_attention_triton(qb, kc8, vc8, meta, d**-0.5, num_splits=splits, block_n=16, fp8_f16=1)
    assert got.dtype == torch.bfloat16 and got.shape == qb.shape
    err = (got.double() - want).abs()
    assert (err <= 2 ** -7 * want.abs() + 2e-3).all(), err.max().item()  # bf16's half step and fp16 products
    # a float32 query is not narrowed: the flag changes nothing there
    torch.testing.assert_close(paged_attention_triton(q, kc8, vc8, meta, d**-0.5, num_splits=splits, block_n=16,
                                                      fp8_f16=1),
                               paged_attention_ref(q, kc8, vc8, meta, d**-0.5), **TOL)
