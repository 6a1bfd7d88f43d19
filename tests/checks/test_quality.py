"""The quality gate's teacher-forced greedy agreement excuses top-1 flips at a rounding tie of the
reference, and only those: synthetic logits with flips planted at known margins."""
from __future__ import annotations

import math

import pytest
import torch

from checks.quality import forced_agreement


def _tie(top: torch.Tensor, noise: float, dtype: torch.dtype) -> torch.Tensor:
    """max(2 * noise, 2 ulp of dtype at |top|), written out: ulp = 2**(floor(log2|x|) - mantissa bits)."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    ulp = torch.exp2(torch.floor(torch.log2(top.abs().double())) - mantissa)
    return torch.clamp(2 * ulp, min=2 * noise)


def _plant_flips(ref: torch.Tensor, rows: torch.Tensor, margins: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A copy of ``ref`` (positions, vocab) whose argmax at each of ``rows`` moves to another token c, with
    the reference's logit for c set to its top-1 logit minus that row's margin."""
    cand = ref.clone()
    vocab = ref.shape[1]
    for r, m in zip(rows.tolist(), margins.tolist()):
        top, arg = ref[r].max(0)
        c = (int(arg) + 1 + int(torch.randint(vocab - 1, (1,), generator=g))) % vocab  # any token but the top-1
        ref[r, c] = top - m
        cand[r] = ref[r]
        cand[r, c] = top + 1.0
    return cand


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flips_within_the_tie_are_excused_and_others_counted(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n, vocab = int(torch.randint(20, 80, (1,), generator=g)), int(torch.randint(50, 500, (1,), generator=g))
    ref = (torch.randn(n, vocab, generator=g) * 4).to(dtype).float()  # (positions, vocab), values dtype can hold
    noise = float(torch.rand((), generator=g)) * 0.3 + 0.05
    assert forced_agreement(ref, ref.clone(), noise, dtype).agreement == 1.0

    perm = torch.randperm(n, generator=g)
    below, above = perm[: n // 4], perm[n // 4 : n // 4 + n // 5]
    top = ref.max(-1).values
    tie = _tie(top, noise, dtype)
    # margins as fractions of each row's tie: (0, 1] is a tie, beyond 1 is decided
    frac = torch.cat([torch.rand(len(below), generator=g) * 0.9 + 0.05, 1.5 + torch.rand(len(above), generator=g)])
    rows = torch.cat([below, above])
    cand = _plant_flips(ref, rows, (frac * tie[rows]).float(), g)

    got = forced_agreement(ref, cand, noise, dtype)
    assert got.positions == n
    assert got.excused == len(below)
    assert got.agreement == pytest.approx((n - len(above)) / n)
    assert got.decided == n - len(below)
    assert (got.first_flip is None) == (len(above) == 0)
    if len(above):
        assert got.first_flip == int(above.min()) and got.first_flip_margin > tie[got.first_flip]


@pytest.mark.parametrize("seed", [0, 1])
def test_ulp_floor_without_noise(seed):
    """With no measured noise, a flip within 2 ulp of bfloat16 is a tie in bfloat16 (not in float32), and one
    beyond 2 ulp is not."""
    g = torch.Generator().manual_seed(seed)
    ref = (torch.randn(8, 64, generator=g) * 4).to(torch.bfloat16).float()  # (positions, vocab)
    ulp = torch.exp2(torch.floor(torch.log2(ref.max(-1).values.abs())) - 7)
    cand = _plant_flips(ref, torch.arange(8), ulp * torch.tensor([1.0, 1.9] * 2 + [2.5] * 4), g)
    bf16 = forced_agreement(ref, cand, 0.0, torch.bfloat16)
    assert (bf16.agreement, bf16.excused, bf16.first_flip) == (0.5, 4, 4)
    fp32 = forced_agreement(ref, cand, 0.0, torch.float32)
    assert (fp32.agreement, fp32.excused, fp32.first_flip) == (0.0, 0, 0)


def test_non_finite_candidate_rows_never_agree():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(10, 32, generator=g)
    cand = ref.clone()
    cand[3, 5], cand[7] = math.nan, math.inf
    got = forced_agreement(ref, cand, 1e3, torch.bfloat16)  # a tie wide enough to excuse any finite flip
    assert (got.agreement, got.excused, got.first_flip) == (0.8, 0, 3)


def test_shapes_must_match():
    with pytest.raises(ValueError, match="differ"):
        forced_agreement(torch.zeros(3, 4), torch.zeros(3, 5), 0.0, torch.float32)
