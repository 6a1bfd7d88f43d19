"""Batch invariance, prefix caching, chunked prefill and preemption on SmolLM2 (float32, CPU)."""
from __future__ import annotations

import pytest

from engine import SamplingParams, VariantSpec

SHARED = ("You are a careful assistant. Answer briefly and precisely, and never invent facts. "
          "The user asks about geography, history and science. ")
PROMPTS = [
    "Hello",
    "The capital of Italy is",
    SHARED + "What is the tallest mountain on Earth?",
    SHARED + "Who wrote the theory of general relativity, and when?",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    SHARED + "Name the largest ocean." + " Please think step by step before you answer it.",
    "A short poem about autumn leaves falling:",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def alone(smollm2_engine_factory):
    """Each prompt run by itself, without prefix caching: the reference."""
    eng = smollm2_engine_factory(num_kv_blocks=64, variant=VariantSpec(enable_prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [eng.generate([p], params)[0].token_ids for p in PROMPTS]


def _concurrent(eng) -> list[list[int]]:
    """All prompts in flight together: half admitted first, the rest joining after three steps."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in PROMPTS[::2]]
    out = {}
    for i in range(3):
        out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    rids += [eng.add_request(p, params) for p in PROMPTS[1::2]]
    while eng.has_unfinished():
        out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    order = [*range(0, len(PROMPTS), 2), *range(1, len(PROMPTS), 2)]
    by_prompt = dict(zip(order, rids))
    return [out[by_prompt[i]] for i in range(len(PROMPTS))]


def test_prompts_have_different_lengths(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=8)
    lengths = [len(eng.encode_prompt(p)) for p in PROMPTS]
    assert len(set(lengths)) == len(lengths)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_concurrent_equals_alone(smollm2_engine_factory, alone, prefix_caching):
    eng = smollm2_engine_factory(num_kv_blocks=128, variant=VariantSpec(enable_prefix_caching=prefix_caching))
    assert _concurrent(eng) == alone
    hits = eng.block_manager.stats.hits
    assert (hits > 0) == prefix_caching  # the shared system text was reused only with caching on


def test_chunked_prefill_equals_alone(smollm2_engine_factory, alone):
    eng = smollm2_engine_factory(
        num_kv_blocks=128, variant=VariantSpec(max_num_batched_tokens=24, max_num_seqs=8)
    )
    assert _concurrent(eng) == alone
    assert eng.stats.steps > MAX_TOKENS + 4  # the long prompts took several chunks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_equals_alone(smollm2_engine_factory, alone, prefix_caching):
    eng = smollm2_engine_factory(num_kv_blocks=10, variant=VariantSpec(block_size=8, enable_prefix_caching=prefix_caching))
    assert _concurrent(eng) == alone
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_free_blocks == 10  # every block came back


def test_max_num_seqs_caps_the_batch(smollm2_engine_factory, alone):
    eng = smollm2_engine_factory(num_kv_blocks=128, variant=VariantSpec(max_num_seqs=3))
    seen = []
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in PROMPTS]
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o.token_ids
        seen.append(len(eng.scheduler.running))
    assert max(seen) == 3
    assert [out[r] for r in rids] == alone


def test_shared_prefix_computes_only_new_tokens(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=64, variant=VariantSpec(block_size=16))
    prefix = eng.encode_prompt(SHARED * 2)[:48]  # exactly three full blocks
    first = prefix + eng.encode_prompt(" What is the capital of Spain?")
    second = prefix + eng.encode_prompt(" Who painted the Mona Lisa? Answer:")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = eng.generate([first], params)[0]
    assert a.num_cached_tokens == 0 and a.num_tokens_run == len(first) + 3
    b = eng.generate([second], params)[0]
    assert b.num_cached_tokens == 48
    # only the new prompt tokens are prefilled, then one token per decode step
    assert b.num_tokens_run == (len(second) - 48) + 3
    # and the answer is the one computed without the cache
    cold = smollm2_engine_factory(num_kv_blocks=64, variant=VariantSpec(enable_prefix_caching=False))
    assert cold.generate([second], params)[0].token_ids == b.token_ids


def test_fully_cached_prompt_still_computes_its_last_token(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=64, variant=VariantSpec(block_size=16))
    prompt = eng.encode_prompt(SHARED * 2)[:64]  # four full blocks
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    a = eng.generate([prompt], params)[0]
    b = eng.generate([prompt], params)[0]
    assert b.num_cached_tokens == 48  # the last block is recomputed so its logits exist
    assert b.token_ids == a.token_ids
