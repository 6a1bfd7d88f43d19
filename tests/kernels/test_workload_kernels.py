"""The workloads' hot-op kernels (kernels/workloads/): the Triton spectral multiply against the einsum and the float64
product, the Triton segment sum against index_add_ and the float64 sum (isolated nodes, repeated destinations, a
batch axis, strided messages), both the same bits on every run, and clear errors for bad inputs
(TRITON_INTERPRET=1 on CPU, tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.workloads.segment_triton import plan_segments, segment_sum, segment_sum_ref
from kernels.workloads.spectral_triton import spectral_mul, spectral_mul_ref


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _real(z: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(z)


# ---- spectral multiply ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,i,o,x,y", [(1, 1, 1, 1, 1), (2, 5, 3, 7, 6), (3, 8, 40, 4, 9)])
def test_spectral_mul_matches_the_einsum_and_the_float64_product(b, i, o, x, y):
    torch.manual_seed(fresh_seed())
    a, w = torch.randn(b, i, x, y, dtype=torch.cfloat), torch.randn(i, o, x, y, dtype=torch.cfloat)
    got = spectral_mul(_real(a), _real(w))
    assert got.shape == (b, o, x, y, 2) and got.dtype == torch.float32
    want = spectral_mul_ref(_real(a), _real(w))
    exact = torch.einsum("bixy,ioxy->boxy", a.to(torch.complex128), w.to(torch.complex128))
    scale = exact.abs().max().item()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale), (got - want).abs().max()
    assert (torch.view_as_complex(got).to(torch.complex128) - exact).abs().max().item() <= 1e-5 * scale * i


def test_spectral_mul_reads_a_corner_of_the_spectrum_in_place_and_repeats_its_bits():
    """The FNO's operand is a slice of rfft2's output (strided); two runs give the same bits."""
    torch.manual_seed(fresh_seed())
    spectrum = torch.randn(2, 4, 20, 11, dtype=torch.cfloat)
    a = spectrum[:, :, -6:, :5]  # the negative-row block, as SpectralConv2d takes it
    w = torch.randn(4, 3, 6, 5, dtype=torch.cfloat)
    first = spectral_mul(_real(a), _real(w))
    assert torch.equal(first, spectral_mul(_real(a), _real(w)))
    assert torch.allclose(first, spectral_mul_ref(_real(a.contiguous()), _real(w)), rtol=1e-5, atol=1e-5)


def test_spectral_mul_says_what_is_wrong():
    a, w = _real(torch.randn(2, 3, 4, 4, dtype=torch.cfloat)), _real(torch.randn(3, 5, 4, 4, dtype=torch.cfloat))
    with pytest.raises(ValueError, match="real views"):
        spectral_mul(a[..., 0], w)
    with pytest.raises(ValueError, match="input channels and modes"):
        spectral_mul(a, w[:2])
    with pytest.raises(ValueError, match="input channels and modes"):
        spectral_mul(a, w[:, :, :3])
    with pytest.raises(ValueError, match="float32"):
        spectral_mul(a.double(), w.double())


# ---- segment sum ------------------------------------------------------------------------------------------------
def _graph(e: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """dst [e] over the first n - 3 nodes only (the last three stay isolated), with repeats."""
    return torch.randint(0, max(n - 3, 1), (e,), generator=gen)


@pytest.mark.parametrize("lead,e,n,f", [((), 40, 12, 7), ((3,), 57, 20, 33), ((2,), 0, 5, 4), ((), 9, 4, 130)])
def test_segment_sum_matches_index_add_and_the_float64_sum(lead, e, n, f):
    gen = torch.Generator().manual_seed(fresh_seed())
    dst = _graph(e, n, gen)
    msg = torch.randn(*lead, e, f, generator=gen)
    got = segment_sum(msg, dst, n)
    assert got.shape == (*lead, n, f) and got.dtype == msg.dtype
    # a CPU's index_add_ adds each node's messages in edge order from zeros, as the kernel does: the same bits
    assert torch.equal(got, segment_sum_ref(msg, dst, n))
    exact = segment_sum_ref(msg.double(), dst, n)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    if n > 3:
        assert not got[..., -3:, :].any()  # nodes without edges get zeros
    assert torch.equal(segment_sum(msg.double(), dst, n), exact)  # float64 messages sum in float64


def test_segment_sum_is_the_same_every_run_and_takes_strided_messages_and_a_plan():
    gen = torch.Generator().manual_seed(fresh_seed())
    dst = torch.cat([torch.full((6,), 2), _graph(30, 9, gen)])  # one node with many repeats
    wide = torch.randn(2, 36, 16, generator=gen)
    msg = wide[:, :, ::2]  # strided features
    first = segment_sum(msg, dst, 9)
    assert torch.equal(first, segment_sum(msg, dst, 9))
    plan = plan_segments(dst, 9)
    assert plan.nodes == 9 and torch.equal(plan.rowptr[1:] - plan.rowptr[:-1], torch.bincount(dst, minlength=9))
    assert torch.equal(segment_sum(msg, dst, 9, plan), first)
    assert torch.equal(first, segment_sum_ref(msg, dst, 9))


def test_segment_sum_says_what_is_wrong():
    msg, dst = torch.randn(5, 3), torch.tensor([0, 1, 1, 2, 0])
    with pytest.raises(ValueError, match=r"\[E, F\] or \[B, E, F\]"):
        segment_sum(msg[:, 0], dst, 3)
    with pytest.raises(ValueError, match="edge axis"):
        segment_sum(msg[:4], dst, 3)
    with pytest.raises(ValueError, match="int64 or int32"):
        segment_sum(msg, dst.float(), 3)
    with pytest.raises(ValueError, match="floating"):
        segment_sum(msg.long(), dst, 3)
    with pytest.raises(ValueError, match=r"lie in \[0, 2\)"):
        segment_sum(msg, dst, 2)
    with pytest.raises(ValueError, match="plan covers"):
        segment_sum(msg, dst, 4, plan_segments(dst, 3))
