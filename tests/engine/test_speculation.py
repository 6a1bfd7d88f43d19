"""Prompt-lookup speculation on SmolLM2 (float32, CPU): greedy output identical to plain decoding when batched,
with prefix caching, chunked prefill and preemption; sampling verified draft by draft; the logits sink sees one
row per emitted token; the contamination gate passes speculation and catches a verification that accepts
unchecked drafts."""
from __future__ import annotations

import dataclasses

import pytest

from checks.engines import factory_for
from checks.report import QualityReport
from engine import SamplingParams, VariantSpec
from engine.sched import speculation
CODE = '''def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]
'''
PROMPTS = [
    "Copy this function exactly, then stop:\n" + CODE + "\nCopy:\n",
    "The capital of Italy is",
    "Count from one to twenty: one, two, three, four, five,",
    "Copy this function exactly, then stop:\n" + CODE + "\nCopy:\ndef merge(a, b):\n",
]
MAX_TOKENS = 24
SPEC = VariantSpec(speculative_tokens=4, speculative_max_batch=8)

pytestmark = pytest.mark.slow  # SmolLM2 generations, and the contamination gate twice


@pytest.fixture(scope="module")
def plain(smollm2_engine_factory):
    """Plain decoding of each prompt, batched (greedy, float32: the reference)."""
    eng = smollm2_engine_factory(num_kv_blocks=256)
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]


def _run_checked(eng, params):
    """Runs PROMPTS to completion, checking after every step that no running sequence holds a block
    beyond its tokens (rejected draft positions released)."""
    rids = [eng.add_request(p, params) for p in PROMPTS]
    done = {}
    bs = eng.block_manager.block_size
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        for seq in eng.scheduler.running:
            assert len(seq.block_table) <= -(-seq.num_tokens // bs), seq.request_id
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return [done[r] for r in rids]


@pytest.mark.parametrize("case", ["batched, prefix caching", "chunked prefill", "no prefix caching"])
def test_speculative_greedy_equals_plain(smollm2_engine_factory, plain, case):
    variant = {"batched, prefix caching": SPEC,
               "chunked prefill": dataclasses.replace(SPEC, prefill_chunk_size=16, max_num_batched_tokens=64),
               "no prefix caching": dataclasses.replace(SPEC, enable_prefix_caching=False)}[case]
    eng = smollm2_engine_factory(num_kv_blocks=256, variant=variant)
    got = _run_checked(eng, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got == plain
    st = eng.stats
    assert st.spec_drafts > 0 and st.spec_accepted_tokens > 0  # speculation ran and paid somewhere
    assert st.generation_tokens == len(PROMPTS) * MAX_TOKENS
    assert 0 < st.spec_acceptance_rate <= 1 and st.spec_mean_accepted_length > 1


def test_speculative_greedy_equals_plain_across_preemption(smollm2_engine_factory, plain):
    lens = [len(smollm2_engine_factory(num_kv_blocks=4).encode_prompt(p)) for p in PROMPTS]
    blocks = max(-(-(n + MAX_TOKENS + SPEC.speculative_tokens) // 16) for n in lens) + 2
    eng = smollm2_engine_factory(num_kv_blocks=blocks, variant=SPEC)
    assert _run_checked(eng, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) == plain
    assert eng.scheduler.num_preemptions > 0 and eng.stats.spec_accepted_tokens > 0


def test_sampling_with_speculation_and_the_logits_sink(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=256, variant=SPEC)
    rows: dict[str, int] = {}
    eng.logits_sink = lambda ids, logits: [rows.__setitem__(i, rows.get(i, 0) + 1) for i in ids]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.3, seed=7),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)]
    outs = eng.generate(PROMPTS[:1] * 2, params)
    assert [len(o.token_ids) for o in outs] == [MAX_TOKENS] * 2
    assert eng.stats.spec_drafts > 0
    # one logits row per emitted token: the gates' per-token comparisons stay aligned
    assert sorted(rows.values()) == [MAX_TOKENS] * 2
    # a seeded request draws the same tokens again
    again = smollm2_engine_factory(num_kv_blocks=256, variant=SPEC).generate(PROMPTS[:1], params[:1])
    assert again[0].token_ids == outs[0].token_ids


def test_the_contamination_gate_passes_speculation_and_catches_unchecked_drafts(smollm2_short, monkeypatch):
    from checks.contamination import contamination_checks
    from checks.prompts import contamination_prompts

    base = smollm2_short  # the first 8 layers: unchecked drafts change 3 of 3 requests in every scenario there
    prompts = contamination_prompts(base, 16)[:3]
    report = QualityReport("reference", "speculating", "float32", len(prompts), 10, False)
    contamination_checks(factory_for(base, SPEC), prompts, 10, 16, report)
    assert all(c.passed for c in report.contamination), report.summary()

    def unchecked(draft, targets):  # a broken verifier: every draft token taken as is
        return [targets[0], *draft] if draft and draft[0] == targets[0] else [targets[0]]
    monkeypatch.setattr(speculation, "accept_greedy", unchecked)
    report = QualityReport("reference", "broken", "float32", len(prompts), 10, False)
    contamination_checks(factory_for(base, SPEC), prompts, 10, 16, report)
    failed = [c for c in report.contamination if not c.passed]
    assert failed and "differ from their run alone" in failed[0].detail
