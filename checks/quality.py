"""The quality gate: a candidate variant against the reference on a prompt set.

Greedy agreement is teacher-forced: along the reference's own tokens, the candidate's top-1 token
must match the reference's at each position, except where the reference itself barely decides it.
A flip counts as a rounding tie (excused, and reported as such) when the reference's margin
between its top-1 logit and the candidate's choice is within the reference's own rounding noise:
twice the most a logit of the reference moves between its batched run and each prompt run alone
(one request in flight), or two units in the last place of the dtype at that logit, whichever is
larger. Random-weight models leave the final logits nearly tied, so in bfloat16 free-running
tokens diverge at once even between correct kernels; a real fault flips decided tokens too. The
free-running prefix agreement is still measured and reported. Max |delta logit| and mean KL are
also taken along the reference's tokens, so one early divergence does not hide later logits.
Exact mode demands bit-identical tokens and logits instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from checks.engines import EngineFactory, GateSettings, generate_tokens
from checks.report import CheckResult, QualityReport, QualityThresholds
from engine.core.llm_engine import LLMEngine


@dataclass(frozen=True)
class ForcedAgreement:
    """Top-1 agreement of a candidate with the reference, position by position along the reference's tokens."""

    positions: int
    agreed: int  # top-1 equal, or a flip excused as a rounding tie
    excused: int  # flips at a rounding tie
    first_flip: int | None = None  # row of the first flip that was not a tie
    first_flip_margin: float | None = None  # the reference's margin there

    @property
    def agreement(self) -> float:
        return self.agreed / self.positions if self.positions else 1.0

    @property
    def decided(self) -> int:
        """Positions the check judged strictly: all but the excused ties."""
        return self.positions - self.excused


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at magnitude |x|: eps * 2**floor(log2|x|)."""
    fi = torch.finfo(dtype)
    return fi.eps * torch.exp2(torch.floor(torch.log2(x.abs().double().clamp_min(fi.tiny))))


def forced_agreement(ref: torch.Tensor, cand: torch.Tensor, noise: float, dtype: torch.dtype) -> ForcedAgreement:
    """ref, cand: (positions, vocab) logits at the same positions. A position agrees when the argmaxes
    match, or when they differ by a tie: the reference's top-1 logit exceeds its logit for the
    candidate's argmax by at most max(2 * noise, 2 ulp of ``dtype`` at the top-1 logit). A row of the
    candidate with NaN/Inf never agrees."""
    if ref.shape != cand.shape:
        raise ValueError(f"reference logits {tuple(ref.shape)} and candidate logits {tuple(cand.shape)} differ")
    ref, cand = ref.double(), cand.double()
    top, ref_arg = ref.max(dim=-1)  # (positions,)
    cand_arg = cand.nan_to_num(nan=-math.inf).argmax(dim=-1)
    finite = torch.isfinite(cand).all(dim=-1)
    margin = top - ref.gather(-1, cand_arg[:, None])[:, 0]
    tie = torch.clamp(2 * ulp(top, dtype), min=2 * noise)
    same = (ref_arg == cand_arg) & finite
    excused = ~same & finite & (margin <= tie)
    flips = (~same & ~excused).nonzero()
    first = int(flips[0, 0]) if len(flips) else None
    return ForcedAgreement(positions=ref.shape[0], agreed=int((same | excused).sum()), excused=int(excused.sum()),
                           first_flip=first, first_flip_margin=None if first is None else float(margin[first]))


def _stack(rows_per_prompt: list[list[torch.Tensor]], lengths: list[int], vocab: int) -> torch.Tensor:
    """(sum(lengths), vocab): each prompt's rows, cut or padded with NaN rows to its length."""
    out = torch.full((sum(lengths), vocab), math.nan)
    at = 0
    for rows, n in zip(rows_per_prompt, lengths):
        if rows[:n]:
            out[at : at + min(n, len(rows))] = torch.stack(rows[:n])
        at += n
    return out


def _free_running(ref_tokens: list[list[int]], cand_tokens: list[list[int]]) -> tuple[float, tuple[int, int] | None]:
    """Mean share of each prompt's reference tokens matched before the first divergence, and where
    the first divergence is: (prompt, token)."""
    agreements, first_div = [], None
    for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreements.append(n / max(1, len(a)))
        if n < len(a) and first_div is None:
            first_div = (i, n)
    return sum(agreements) / len(agreements), first_div


def _batch_noise(ref: LLMEngine, prompts: list[list[int]], tokens: list[list[int]],
                 batched: list[list[torch.Tensor]]) -> float:
    """The reference's own rounding noise: the most any logit moves between its batched run and each
    prompt run alone (one request in flight), teacher-forced along the same tokens."""
    noise = 0.0
    for p, toks, rows_b in zip(prompts, tokens, batched):
        _, (rows_a,) = generate_tokens(ref, [p], len(toks), forced=[toks], record_logits=True)
        for lb, la in zip(rows_b, rows_a):
            noise = max(noise, (lb - la).abs().max().item())
    return noise


def quality_checks(reference: EngineFactory, candidate: EngineFactory, prompts: list[list[int]], max_tokens: int,
                   thresholds: QualityThresholds, exact: bool, report: QualityReport) -> None:
    settings = GateSettings(num_kv_blocks=len(prompts) * 64 + 64, enable_prefix_caching=False)
    ref = reference(settings)
    ref_tokens, ref_logits = generate_tokens(ref, prompts, max_tokens, record_logits=True)
    cand = candidate(settings)
    cand_tokens, _ = generate_tokens(cand, prompts, max_tokens)
    _, forced_logits = generate_tokens(cand, prompts, max_tokens, forced=ref_tokens, record_logits=True)

    free, first_div = _free_running(ref_tokens, cand_tokens)
    max_delta, kls, finite = 0.0, [], True
    for rows_r, rows_c in zip(ref_logits, forced_logits):
        for lr, lc in zip(rows_r, rows_c):
            if not torch.isfinite(lc).all():
                finite = False
                continue
            max_delta = max(max_delta, (lr - lc).abs().max().item())
            pr = torch.log_softmax(lr.double(), -1)
            pc = torch.log_softmax(lc.double(), -1)
            kls.append(float((pr.exp() * (pr - pc)).sum()))
    mean_kl = sum(kls) / len(kls) if kls else math.inf
    div = f" (first divergence: prompt {first_div[0]}, token {first_div[1]})" if first_div else ""
    q = report.quality
    q.append(CheckResult("finite logits", finite, "all finite" if finite else "the candidate produced NaN/Inf logits"))

    noise = 0.0 if exact else _batch_noise(ref, prompts, ref_tokens, ref_logits)  # exact mode tolerates none
    lengths = [len(rows) for rows in ref_logits]
    vocab = ref_logits[0][0].shape[-1] if lengths and lengths[0] else 1
    fa = forced_agreement(_stack(ref_logits, lengths, vocab), _stack(forced_logits, lengths, vocab), noise,
                          getattr(torch, report.dtype))
    report.greedy_agreement, report.free_running_agreement = fa.agreement, free
    report.excused_ties, report.decided_positions = fa.excused, fa.decided
    report.tie_margin = None if exact else 2 * noise
    report.max_abs_logit_delta, report.mean_kl = max_delta, mean_kl
    if exact:
        same = ref_tokens == cand_tokens and max_delta == 0.0 and finite
        q.append(CheckResult("exact", same, "bit-identical tokens and logits" if same else
                             f"claims exactness but max |dlogit| = {max_delta:.3g}, agreement {free:.3f}{div}"))
        return
    t = thresholds
    flip = ""
    if fa.first_flip is not None:
        at = [(i, j) for i, n in enumerate(lengths) for j in range(n)][fa.first_flip]
        flip = (f"; first decided flip: prompt {at[0]}, token {at[1]} (reference margin "
                f"{fa.first_flip_margin:.3g})")
    q.append(CheckResult("greedy agreement", fa.agreement >= t.min_greedy_agreement,
                         f"{fa.agreement:.3f} of {fa.positions} positions (min {t.min_greedy_agreement}); "
                         f"{fa.excused} flips excused as rounding ties (reference margin <= {2 * noise:.3g} = 2x its "
                         f"batch noise {noise:.3g} or 2 ulp){flip}; free-running {free:.3f}{div}"))
    q.append(CheckResult("max |dlogit|", max_delta <= t.max_abs_logit_delta,
                         f"{max_delta:.3g} (max {t.max_abs_logit_delta:g}) along the reference's tokens"))
    q.append(CheckResult("mean KL", mean_kl <= t.max_mean_kl, f"{mean_kl:.3g} (max {t.max_mean_kl:g})"))
