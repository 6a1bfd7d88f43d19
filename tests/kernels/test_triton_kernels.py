"""The norm, activation, rotary, KV-store and attention Triton kernels equal their plain-torch references on fresh
random inputs (TRITON_INTERPRET=1 on CPU); the MoE, linear and prefetch kernels: test_triton_moe_linear.py."""
from __future__ import annotations

import random

import pytest
import torch

from kernels.pointwise.activation import silu_and_mul_ref
from kernels.pointwise.activation_triton import silu_and_mul_triton
from kernels.attention.attention import AttentionMetadata, paged_attention_ref
from kernels.attention.attention_triton import paged_attention_triton, split_kv_attention_triton
from kernels.attention.kv_store import store_kv_ref
from kernels.attention.kv_store_triton import store_kv_triton
from kernels.pointwise.norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.pointwise.norm_triton import fused_add_rms_norm_triton, rms_norm_triton
from kernels.attention.rotary import rotary_ref
from kernels.attention.rotary_triton import rotary_triton

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
    from engine.config.model_config import ModelConfig
    from engine.model.rope import rope_cos_sin

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

    from engine.config.model_config import ModelConfig
    from engine.model.rope import rope_cos_sin
    from kernels.attention.rotary import norm_rotary_store_kv_ref, rotary_store_kv_ref
    from kernels.attention.rotary_triton import norm_rotary_store_kv_triton, rotary_store_kv_triton

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
    (4, 2, 16, 16, [(150, 40), (90, 90), (33, 1)]),  # chunks after long contexts: unmasked tiles, then diagonal
]


@pytest.mark.parametrize("case", CASES)
def test_paged_attention(case):
    heads, kvh, d, bs, specs = case
    q, kc, vc, meta = _paged_case(len(specs) * 31 + d, heads, kvh, d, bs, specs)
    ref = paged_attention_ref(q, kc, vc, meta, d**-0.5)
    # prefill tiles: rows, keys; the last reads the tile order the first left on the step's metadata
    for block_m, block_n in ((16, 16), (32, 64), (64, 16), (16, 32)):
        got = paged_attention_triton(q, kc, vc, meta, d**-0.5, block_m=block_m, prefill_block_n=block_n)
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
def decode_block_case(heads, kvh, d, bs, contexts, norm, seed):
    """Inputs of a decode batch's attention block: strided q/k/v views of a fused projection, head-norm weights
    (or None), positions, the rotary table, a scattered paged cache and the metadata whose slots are each
    sequence's last position."""
    from engine.config.model_config import ModelConfig
    from engine.model.rope import rope_cos_sin

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
    from kernels.attention.attention import rotary_attention_ref
    from kernels.attention.attention_triton import rotary_attention_triton
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


def test_prefill_attention_reads_padded_tiles_from_static_buffers():
    """A captured step (engine/worker/step_graphs.py): more sequence slots and query rows than the step has, and
    the tile list padded to a fixed count with tiles of an empty sequence. The real rows equal the reference; the
    padding computes nothing."""
    from kernels.attention.prefill_triton import tile_key, tile_order

    heads, kvh, d, bs, specs = 4, 2, 16, 8, [(40, 12), (9, 1), (30, 30)]
    q, kc, vc, meta = _paged_case(7, heads, kvh, d, bs, specs)
    ref = paged_attention_ref(q, kc, vc, meta, d**-0.5)
    n, slots, pad_rows, block_m = q.shape[0], 6, 21, 16  # six sequence slots (three used), 21 padding rows
    ctx = meta.context_lens + [0] * (slots + 1 - len(specs))
    qsl = meta.query_start_loc + [n] * (slots + 1 - len(specs))
    tables = torch.zeros((slots + 1, meta.block_tables.shape[1]), dtype=torch.int32)
    tables[:len(specs)] = meta.block_tables
    padded = AttentionMetadata(torch.zeros(n + pad_rows, dtype=torch.int64), tables, ctx, qsl,
                               torch.tensor(ctx, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                               max_query_len=2, max_context_len=64)
    seqs, rows = tile_order(meta.context_lens, meta.query_start_loc, block_m)
    count = -(-(n + pad_rows) // block_m) + slots
    assert count > len(seqs)
    seq_buf = torch.tensor(seqs + [slots] * (count - len(seqs)), dtype=torch.int32)
    row_buf = torch.tensor(rows + [0] * (count - len(rows)), dtype=torch.int32)
    padded.derived[tile_key(block_m)] = (count, seq_buf, row_buf)
    qp = torch.cat([q, torch.full((pad_rows, heads, d), float("nan"))])
    got = paged_attention_triton(qp, kc, vc, padded, d**-0.5, block_m=block_m, prefill_block_n=16)
    torch.testing.assert_close(got[:n], ref, **TOL)
