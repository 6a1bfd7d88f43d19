"""The KV-cache contamination gate: a request's output must not depend on its neighbours or its history.

Each request's greedy tokens are compared with its run alone (no prefix caching) when batched;
interleaved with requests that share its prefix, with prefix caching on and every newly handed
out block poisoned with NaN; on a second pass that hits the cache; across preemption and
resume in a pool too small for all; and across a kv_layout + scheduler hot swap. The run alone does not
speculate, so a variant with prompt-lookup speculation must reproduce plain decoding in every scenario.

Exact in float32. In bfloat16 and float16 a batched matmul rounds differently from a single one,
so greedy tokens can flip at near-ties without any contamination; there a scenario whose tokens
differ is run again teacher-forced along the alone tokens, and passes only if every position's
KL divergence from the alone run stays within a tolerance (reading the wrong KV moves the
distribution far more than rounding does).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from checks.engines import EngineFactory, GateSettings, blocks_needed, drain
from checks.report import CheckResult, QualityReport
from engine.core.llm_engine import LLMEngine
from engine.config.sampling_params import SamplingParams


def _poison_on_allocate(eng: LLMEngine) -> None:
    """Every block handed out for new data is filled with NaN first: reading it before writing shows."""
    eng.block_manager.on_allocate = lambda ids: eng.kv.poison(ids)


def _differ(got: list[list[int]], want: list[list[int]]) -> list[tuple[int, int]]:
    return [(i, next((j for j, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w))))
            for i, (g, w) in enumerate(zip(got, want)) if g != w]


def _run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, forced: list[list[int]] | None = None,
         waves: bool = False, between=None) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Runs the prompts (all at once, or in two waves with ``between(eng)`` after three steps);
    with ``forced``, teacher-forced along those tokens and each step's logits recorded."""
    logits: dict[str, list[torch.Tensor]] = {}
    if forced is not None:
        def sink(rids, rows):
            for rid, row in zip(rids, rows):
                logits.setdefault(rid, []).append(row.detach().float().cpu().clone())
        eng.logits_sink = sink

    def add(i: int) -> str:
        return eng.add_request(prompts[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True, forced_tokens=tuple(
            forced[i]) if forced is not None else ()))

    try:
        half = len(prompts) // 2 if waves else len(prompts)
        rids = [add(i) for i in range(half)]
        done: dict[str, list[int]] = {}
        if waves:
            for _ in range(3):
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o.token_ids
            if between is not None:
                between(eng)
            rids += [add(i) for i in range(half, len(prompts))]
        drain(eng, rids, done)
    finally:
        eng.logits_sink = None
    return [done[r] for r in rids], [logits.get(r, []) for r in rids]


@dataclass
class _Scenario:
    name: str
    make: Callable[[], LLMEngine]  # a fresh engine set up for the scenario
    prompts: list[list[int]]
    max_tokens: int
    waves: bool = False
    between: Callable | None = None


def _check(sc: _Scenario, alone: list[list[int]], alone_logits: list[list[torch.Tensor]] | None,
           tolerance: float, extra: Callable[[LLMEngine], str] = lambda e: "") -> tuple[CheckResult, LLMEngine]:
    """Tokens must equal the run alone. Under a tolerance (bf16, fp16: batched and single matmuls round
    differently), tokens that differ pass only if the scenario teacher-forced along the alone tokens
    keeps every position's KL(alone || scenario) within it: rounding moves the distribution a little,
    reading the wrong KV moves it a lot."""
    eng = sc.make()
    got, _ = _run(eng, sc.prompts, sc.max_tokens, waves=sc.waves, between=sc.between)
    note = extra(eng)
    bad = _differ(got, alone)
    if not bad:
        return CheckResult(sc.name, True, f"{len(got)} requests equal their run alone{note}"), eng
    i, j = bad[0]
    detail = f"{len(bad)}/{len(got)} requests differ from their run alone (first: prompt {i} at token {j}){note}"
    if tolerance <= 0 or alone_logits is None:
        return CheckResult(sc.name, False, detail), eng
    _, forced = _run(sc.make(), sc.prompts, sc.max_tokens, forced=alone, waves=sc.waves, between=sc.between)
    delta, worst_kl, finite = 0.0, 0.0, True
    for rows_a, rows_f in zip(alone_logits, forced):
        if len(rows_a) != len(rows_f):
            return CheckResult(sc.name, False, detail + "; the teacher-forced rerun lost steps"), eng
        for la, lf in zip(rows_a, rows_f):
            if not torch.isfinite(lf).all():
                finite = False
                continue
            delta = max(delta, (la - lf).abs().max().item())
            pa, pf = torch.log_softmax(la.double(), -1), torch.log_softmax(lf.double(), -1)
            worst_kl = max(worst_kl, float((pa.exp() * (pa - pf)).sum()))
    ok = finite and worst_kl <= tolerance
    return CheckResult(sc.name, ok, f"{detail}; teacher-forced along the alone tokens: max KL {worst_kl:.3g} "
                                    f"({'within' if ok else 'over'} the {tolerance:g} rounding tolerance), "
                                    f"max |dlogit| {delta:.3g}{'' if finite else ', NaN/Inf logits'}"), eng


def contamination_checks(candidate: EngineFactory, prompts: list[list[int]], max_tokens: int, block_size: int,
                         report: QualityReport, tolerance: float = 0.0) -> None:
    c = report.contamination
    # second-pass prompts extend the first ones: their lookups hit cached blocks, then miss
    extended = [p + p[: 2 * block_size] for p in prompts]
    # every request of the preemption check crosses a block boundary while decoding, so a pool that
    # holds only the largest request must preempt; greedy runs are prefixes of longer ones
    long_tokens = max(max_tokens, block_size + 2)
    big = len(prompts) * (blocks_needed(prompts, long_tokens, block_size) + 2) * 2 + 16
    # the run alone does not speculate: a speculating variant's tokens must equal plain decoding's
    solo = candidate(GateSettings(big * 2, enable_prefix_caching=False, speculate=False))

    def alone_of(ps: list[list[int]], n: int) -> tuple[list[list[int]], list | None]:
        toks = [_run(solo, [p], n)[0][0] for p in ps]
        if tolerance <= 0:
            return toks, None
        return toks, [_run(solo, [p], n, forced=[t])[1][0] for p, t in zip(ps, toks)]

    alone, alone_logits = alone_of(prompts, max_tokens)
    alone_long, alone_long_logits = alone_of(prompts, long_tokens)
    alone_ext, alone_ext_logits = alone_of(extended, max_tokens)

    def poisoned(blocks: int, caching: bool = True) -> Callable[[], LLMEngine]:
        def make() -> LLMEngine:
            eng = candidate(GateSettings(blocks, enable_prefix_caching=caching))
            _poison_on_allocate(eng)
            return eng
        return make

    res, _ = _check(_Scenario("batched", lambda: candidate(GateSettings(big, enable_prefix_caching=False)), prompts,
                              max_tokens), alone, alone_logits, tolerance)
    c.append(res)

    # the cache check reuses the blocks the interleaved wave left behind: both waves run on one engine
    cache_engine: dict[str, LLMEngine] = {}

    def warm_cache() -> LLMEngine:
        eng = poisoned(big)()
        _run(eng, prompts, max_tokens, waves=True)
        cache_engine["hits_before"] = eng.block_manager.stats.hits
        return eng

    res, _ = _check(_Scenario("interleaved, shared prefixes, prefix caching on", poisoned(big), prompts, max_tokens,
                              waves=True), alone, alone_logits, tolerance)
    c.append(res)
    res, _ = _check(_Scenario("prefix cache hits on poisoned, reused blocks", warm_cache, extended, max_tokens,
                              waves=True), alone_ext, alone_ext_logits, tolerance,
                    lambda e: f"; {e.block_manager.stats.hits - cache_engine['hits_before']} cached tokens reused")
    c.append(res)

    small = blocks_needed(prompts, long_tokens, block_size)
    res, eng = _check(_Scenario("preemption and resume", poisoned(small), prompts, long_tokens), alone_long,
                      alone_long_logits, tolerance,
                      lambda e: f"; {e.scheduler.num_preemptions} preemptions in a {small}-block pool")
    pre = eng.scheduler.num_preemptions
    if not pre and eng.scheduler.config.max_num_seqs > 1:
        res = CheckResult(res.name, False, "the pool did not force a preemption: check not exercised")
    elif not pre:
        res = CheckResult(res.name, res.passed, res.detail + " (max_num_seqs=1: nothing to preempt)")
    c.append(res)

    def swap(e: LLMEngine) -> None:
        v = e.variant
        e.apply_variant(dataclasses.replace(v, block_size=max(1, v.block_size // 2),
                                            max_num_batched_tokens=max(64, v.max_num_batched_tokens // 2)))
        _poison_on_allocate(e)  # the rebuilt pool has a new block manager
    res, _ = _check(_Scenario("across a hot swap (kv_layout + scheduler)", poisoned(big), prompts, max_tokens,
                              waves=True, between=swap), alone, alone_logits, tolerance)
    c.append(res)
