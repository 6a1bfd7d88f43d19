"""The KV-cache contamination gate: a request's output must not depend on its neighbours or its history.

Each request's greedy tokens are compared with its run alone (no prefix caching) when batched;
interleaved with requests that share its prefix, with prefix caching on and every newly handed
out block poisoned with NaN; on a second pass that hits the cache; across preemption and
resume in a pool too small for all; and across a kv_layout + scheduler hot swap.
"""
from __future__ import annotations

import dataclasses

from checks.engines import EngineFactory, GateSettings, blocks_needed, drain, generate_tokens
from checks.report import CheckResult, QualityReport
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


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
    drain(eng, rids, done)
    return [done[r] for r in rids]


def contamination_checks(candidate: EngineFactory, prompts: list[list[int]], max_tokens: int, block_size: int,
                         report: QualityReport) -> None:
    c = report.contamination
    # second-pass prompts extend the first ones: their lookups hit cached blocks, then miss
    extended = [p + p[: 2 * block_size] for p in prompts]
    # every request of the preemption check crosses a block boundary while decoding, so a pool that
    # holds only the largest request must preempt; greedy runs are prefixes of longer ones
    long_tokens = max(max_tokens, block_size + 2)
    big = len(prompts) * (blocks_needed(prompts, long_tokens, block_size) + 2) * 2 + 16
    solo = candidate(GateSettings(big * 2, enable_prefix_caching=False))
    alone_long = [generate_tokens(solo, [p], long_tokens)[0][0] for p in prompts]
    alone = [t[:max_tokens] for t in alone_long]
    alone_ext = [generate_tokens(solo, [p], max_tokens)[0][0] for p in extended]

    eng = candidate(GateSettings(big, enable_prefix_caching=False))
    c.append(_compare("batched", generate_tokens(eng, prompts, max_tokens)[0], alone))

    eng = candidate(GateSettings(big, enable_prefix_caching=True))
    _poison_on_allocate(eng)
    c.append(_compare("interleaved, shared prefixes, prefix caching on", _waves(eng, prompts, max_tokens), alone))
    hits_before = eng.block_manager.stats.hits
    second = _waves(eng, extended, max_tokens)
    hits = eng.block_manager.stats.hits - hits_before
    c.append(_compare("prefix cache hits on poisoned, reused blocks", second, alone_ext,
                      f"; {hits} cached tokens reused"))

    small = blocks_needed(prompts, long_tokens, block_size)
    eng = candidate(GateSettings(small, enable_prefix_caching=True))
    _poison_on_allocate(eng)
    got = generate_tokens(eng, prompts, long_tokens)[0]
    pre = eng.scheduler.num_preemptions
    res = _compare("preemption and resume", got, alone_long, f"; {pre} preemptions in a {small}-block pool")
    if not pre and eng.scheduler.config.max_num_seqs > 1:
        res = CheckResult(res.name, False, "the pool did not force a preemption: check not exercised")
    elif not pre:
        res = CheckResult(res.name, res.passed, res.detail + " (max_num_seqs=1: nothing to preempt)")
    c.append(res)

    eng = candidate(GateSettings(big, enable_prefix_caching=True))
    _poison_on_allocate(eng)

    def swap(e: LLMEngine) -> None:
        v = e.variant
        e.apply_variant(dataclasses.replace(v, block_size=max(1, v.block_size // 2),
                                            max_num_batched_tokens=max(64, v.max_num_batched_tokens // 2)))
        _poison_on_allocate(e)  # the rebuilt pool has a new block manager
    c.append(_compare("across a hot swap (kv_layout + scheduler)", _waves(eng, prompts, max_tokens, swap), alone))


