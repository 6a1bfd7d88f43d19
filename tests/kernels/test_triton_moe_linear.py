"""The MoE, linear (matrix-vector) and L2-prefetch Triton kernels equal their plain-torch references on fresh random
inputs (TRITON_INTERPRET=1 on CPU); the prefetch's stream logic on stand-in streams."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
@pytest.mark.parametrize("t,h,e,k,i,renorm", [(1, 16, 4, 2, 8, True), (9, 40, 6, 2, 24, False),
                                               (33, 32, 8, 3, 20, True), (5, 24, 3, 3, 16, False)])
def test_moe_grouped_matmul(t, h, e, k, i, renorm):
    from kernels.moe.moe import moe_ref
    from kernels.moe.moe_triton import make_moe, moe_triton

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
    from kernels.moe.moe import moe_ref, moe_route_ref, norm_moe_ref
    from kernels.counters import ArrivalCounters
    from kernels.moe.moe_triton import norm_moe_triton
    from kernels.pointwise.norm import fused_add_rms_norm_ref

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
    from kernels.moe.moe import moe_route_ref
    from kernels.moe.moe_route_triton import moe_route_triton

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
    from kernels.linear.linear import act_linear_ref, linear_ref, norm_linear_ref
    from kernels.linear.linear_triton import act_linear_triton, linear_triton, norm_linear_triton

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
    import kernels.linear.linear_triton as lt
    from kernels.linear.linear import norm_linear_ref

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
    from kernels.attention.prefetch import no_join, prefetch_ref
    from kernels.attention.prefetch_triton import prefetch_sums, prefetch_triton

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
    """kernels.attention.prefetch_triton's stream logic on a CPU: streams, events and the kernel's launch logged."""
    import contextlib
    import threading

    from kernels.attention import prefetch_triton as pt
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

    from kernels.attention.prefetch import no_join

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
    from kernels.attention.prefetch_triton import make_prefetch

    make_prefetch(next_qkv=2, defer_join=1, programs=264)
    for bad, reason in (({"next_qkv": 3}, "next_qkv"), ({"o_proj": True}, "o_proj"), ({"programs": 0}, "programs"),
                        ({"block": 1000}, "powers of two")):
        with pytest.raises(ValueError, match=reason):
            make_prefetch(**bad)
    with pytest.raises(TypeError, match="unknown parameters defer"):
        make_prefetch(defer=1)
