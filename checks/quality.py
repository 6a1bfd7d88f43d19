"""The quality gate: a candidate variant against the reference on a prompt set.

Greedy token agreement from free-running generation; max |delta logit| and mean KL along the
reference's own tokens (teacher forcing), so one early divergence does not hide later logits.
"""
from __future__ import annotations

import math

import torch

from checks.engines import EngineFactory, GateSettings, generate_tokens
from checks.report import CheckResult, QualityReport, QualityThresholds


def quality_checks(reference: EngineFactory, candidate: EngineFactory, prompts: list[list[int]], max_tokens: int,
                   thresholds: QualityThresholds, exact: bool, report: QualityReport) -> None:
    settings = GateSettings(num_kv_blocks=len(prompts) * 64 + 64, enable_prefix_caching=False)
    ref = reference(settings)
    ref_tokens, ref_logits = generate_tokens(ref, prompts, max_tokens, record_logits=True)
    cand = candidate(settings)
    cand_tokens, _ = generate_tokens(cand, prompts, max_tokens)
    _, forced_logits = generate_tokens(cand, prompts, max_tokens, forced=ref_tokens, record_logits=True)

    agreements, first_div = [], None
    for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreements.append(n / max(1, len(a)))
        if n < len(a) and first_div is None:
            first_div = (i, n)
    agreement = sum(agreements) / len(agreements)
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
    report.greedy_agreement, report.max_abs_logit_delta, report.mean_kl = agreement, max_delta, mean_kl
    div = f" (first divergence: prompt {first_div[0]}, token {first_div[1]})" if first_div else ""
    q = report.quality
    q.append(CheckResult("finite logits", finite, "all finite" if finite else "the candidate produced NaN/Inf logits"))
    if exact:
        same = ref_tokens == cand_tokens and max_delta == 0.0 and finite
        q.append(CheckResult("exact", same, "bit-identical tokens and logits" if same else
                             f"claims exactness but max |dlogit| = {max_delta:.3g}, agreement {agreement:.3f}{div}"))
        return
    t = thresholds
    q.append(CheckResult("greedy agreement", agreement >= t.min_greedy_agreement,
                         f"{agreement:.3f} (min {t.min_greedy_agreement}){div}"))
    q.append(CheckResult("max |dlogit|", max_delta <= t.max_abs_logit_delta,
                         f"{max_delta:.3g} (max {t.max_abs_logit_delta:g}) along the reference's tokens"))
    q.append(CheckResult("mean KL", mean_kl <= t.max_mean_kl, f"{mean_kl:.3g} (max {t.max_mean_kl:g})"))


