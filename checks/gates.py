"""The quality and KV-cache contamination gates, as plain functions over engine factories.

A factory builds an engine of one variant with the settings a check needs (pool size, prefix
caching) over weights that are already loaded. ``run_gates`` runs both gates and returns one
QualityReport; a failed check names itself and what it saw.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from checks.prompts import contamination_prompts, shipped_prompts
from checks.report import DEFAULT_THRESHOLDS, CheckResult, QualityReport, QualityThresholds
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.variant import VariantSpec


@dataclass(frozen=True)
class GateSettings:
    num_kv_blocks: int
    enable_prefix_caching: bool


EngineFactory = Callable[[GateSettings], LLMEngine]


def factory_for(base: LLMEngine, spec: VariantSpec) -> EngineFactory:
    """Engines of ``spec`` over ``base``'s loaded weights (no reload)."""
    def make(s: GateSettings) -> LLMEngine:
        variant = dataclasses.replace(spec, enable_prefix_caching=s.enable_prefix_caching)
        return LLMEngine(dataclasses.replace(base.config, num_kv_blocks=s.num_kv_blocks, variant=variant), base.loaded)
    return make


# ---- running prompts ---------------------------------------------------------------------------------
def _drain(eng: LLMEngine, rids: list[str], done: dict[str, list[int]]) -> None:
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids


def _generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, forced: list[list[int]] | None = None,
              record_logits: bool = False) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """All prompts together; returns tokens and (optionally) each request's per-step logits."""
    logits: dict[str, list[torch.Tensor]] = {}
    if record_logits:
        def sink(rids, rows):
            for rid, row in zip(rids, rows):
                logits.setdefault(rid, []).append(row.detach().float().cpu().clone())
        eng.logits_sink = sink
    rids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                              forced_tokens=tuple(forced[i]) if forced else ()))
            for i, p in enumerate(prompts)]
    done: dict[str, list[int]] = {}
    try:
        _drain(eng, rids, done)
    finally:
        eng.logits_sink = None
    return [done[r] for r in rids], [logits.get(r, []) for r in rids]


def _blocks_needed(prompts, max_tokens, block_size) -> int:
    return max(-(-(len(p) + max_tokens) // block_size) for p in prompts)


# ---- quality ---------------------------------------------------------------------------------------------
def quality_checks(reference: EngineFactory, candidate: EngineFactory, prompts: list[list[int]], max_tokens: int,
                   thresholds: QualityThresholds, exact: bool, report: QualityReport) -> None:
    settings = GateSettings(num_kv_blocks=len(prompts) * 64 + 64, enable_prefix_caching=False)
    ref = reference(settings)
    ref_tokens, ref_logits = _generate(ref, prompts, max_tokens, record_logits=True)
    cand = candidate(settings)
    cand_tokens, _ = _generate(cand, prompts, max_tokens)
    _, forced_logits = _generate(cand, prompts, max_tokens, forced=ref_tokens, record_logits=True)

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


# ---- contamination ---------------------------------------------------------------------------------------
def _poison_on_allocate(eng: LLMEngine) -> None:
    """Every block handed out for new data is filled with NaN first: reading it before writing shows."""
    eng.block_manager.on_allocate = lambda ids: eng.kv.poison(ids)


def _compare(name: str, got: list[list[int]], want: list[list[int]], extra: str = "") -> CheckResult:
    bad = [(i, next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w))))
           for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if not bad:
        return CheckResult(name, True, f"{len(got)} requests equal their run alone{extra}")
    i, j = bad[0]
    return CheckResult(name, False, f"{len(bad)}/{len(got)} requests differ from their run alone "
                                    f"(first: prompt {i} at token {j}){extra}")


def _waves(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, between=None) -> list[list[int]]:
    """First half admitted, three steps, then ``between(eng)``, then the second half."""
    half = len(prompts) // 2
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in prompts[:half]]
    done: dict[str, list[int]] = {}
    for _ in range(3):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    if between is not None:
        between(eng)
    rids += [eng.add_request(p, params) for p in prompts[half:]]
    _drain(eng, rids, done)
    return [done[r] for r in rids]


def contamination_checks(candidate: EngineFactory, prompts: list[list[int]], max_tokens: int, block_size: int,
                         report: QualityReport) -> None:
    big = len(prompts) * (_blocks_needed(prompts, max_tokens, block_size) + 2) * 2 + 16
    c = report.contamination
    # second-pass prompts extend the first ones: their lookups hit cached blocks, then miss
    extended = [p + p[: 2 * block_size] for p in prompts]
    solo = candidate(GateSettings(big * 2, enable_prefix_caching=False))
    alone = [_generate(solo, [p], max_tokens)[0][0] for p in prompts]
    alone_ext = [_generate(solo, [p], max_tokens)[0][0] for p in extended]

    eng = candidate(GateSettings(big, enable_prefix_caching=False))
    c.append(_compare("batched", _generate(eng, prompts, max_tokens)[0], alone))

    eng = candidate(GateSettings(big, enable_prefix_caching=True))
    _poison_on_allocate(eng)
    c.append(_compare("interleaved, shared prefixes, prefix caching on", _waves(eng, prompts, max_tokens), alone))
    hits_before = eng.block_manager.stats.hits
    second = _waves(eng, extended, max_tokens)
    hits = eng.block_manager.stats.hits - hits_before
    c.append(_compare("prefix cache hits on poisoned, reused blocks", second, alone_ext,
                      f"; {hits} cached tokens reused"))

    small = _blocks_needed(prompts, max_tokens, block_size) + 2
    eng = candidate(GateSettings(small, enable_prefix_caching=True))
    _poison_on_allocate(eng)
    got = _generate(eng, prompts, max_tokens)[0]
    pre = eng.scheduler.num_preemptions
    res = _compare("preemption and resume", got, alone, f"; {pre} preemptions in a {small}-block pool")
    c.append(res if pre else CheckResult(res.name, False, "the pool did not force a preemption: check not exercised"))

    eng = candidate(GateSettings(big, enable_prefix_caching=True))
    _poison_on_allocate(eng)

    def swap(e: LLMEngine) -> None:
        v = e.variant
        e.apply_variant(dataclasses.replace(v, block_size=max(1, v.block_size // 2),
                                            max_num_batched_tokens=max(64, v.max_num_batched_tokens // 2)))
        _poison_on_allocate(e)  # the rebuilt pool has a new block manager
    c.append(_compare("across a hot swap (kv_layout + scheduler)", _waves(eng, prompts, max_tokens, swap), alone))


# ---- both --------------------------------------------------------------------------------------------------
def run_gates(reference: EngineFactory, candidate: EngineFactory, *, reference_id: str, candidate_id: str,
              dtype: str, prompts: list[list[int]] | None = None, contamination: list[list[int]] | None = None,
              max_tokens: int = 12, thresholds: QualityThresholds | None = None, exact: bool = False,
              block_size: int = 16) -> QualityReport:
    t0 = time.perf_counter()
    probe = candidate(GateSettings(8, enable_prefix_caching=False))
    prompts = prompts or shipped_prompts(probe)
    contamination = contamination or contamination_prompts(probe, block_size)
    report = QualityReport(reference_variant=reference_id, candidate_variant=candidate_id, dtype=dtype,
                           prompts=len(prompts) + len(contamination), max_tokens=max_tokens, exact=exact)
    try:
        quality_checks(reference, candidate, prompts, max_tokens, thresholds or DEFAULT_THRESHOLDS[dtype], exact,
                       report)
        contamination_checks(candidate, contamination, max_tokens, block_size, report)
    except Exception as e:  # a candidate that crashes is a failed candidate, not a crashed gate
        report.quality.append(CheckResult("runs", False, f"{type(e).__name__}: {e}"))
    report.seconds = time.perf_counter() - t0
    return report


def gate_variant(base: LLMEngine, candidate: VariantSpec, reference: VariantSpec | None = None,
                 **kwargs) -> QualityReport:
    """The gates for a VariantSpec over ``base``'s weights, against the reference (plain-torch) variant."""
    from engine.variant import REFERENCE_VARIANT

    reference = reference or dataclasses.replace(REFERENCE_VARIANT, block_size=candidate.block_size)
    return run_gates(factory_for(base, reference), factory_for(base, candidate), reference_id=reference.variant_id,
                     candidate_id=candidate.variant_id, dtype=base.config.dtype, block_size=candidate.block_size,
                     **kwargs)
