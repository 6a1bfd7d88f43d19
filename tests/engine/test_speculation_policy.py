"""Prompt-lookup speculation without a model: the proposer, verification (greedy and rejection sampling,
checked statistically against the target distribution), the adaptive policy and the scheduler's drafts."""
from __future__ import annotations

import random

import pytest
import torch

from engine.sched.block_manager import BlockManager
from engine.errors import ConfigError
from engine.config.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Sequence
from engine.sched.speculation import PAUSE_TOKENS, SpecState, accept_greedy, accept_sampled, propose
from engine.config.variant import VariantSpec


def test_propose_takes_the_tokens_after_the_most_recent_longest_match():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose(toks, 2, 3, 1) == [7, 8]  # "1 2 3" last seen at 5..7, followed by 7 8
    assert propose(toks, 10, 3, 1) == [7, 8, 5, 1, 2, 3]  # as far as the tokens go
    assert propose([4, 5, 6, 7], 3, 3, 1) == []  # nothing repeats
    assert propose([5, 6, 5], 3, 3, 2) == []  # only a 1-gram matches, below the minimum
    assert propose([5, 6, 5], 3, 3, 1) == [6, 5]
    assert propose([5, 6, 5], 0, 3, 1) == []
    assert propose([5], 3, 3, 1) == []


def test_propose_against_a_brute_force_reference():
    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(2, 30))]
        k, n_max = rng.randrange(1, 6), rng.randrange(1, 5)
        n_min = rng.randrange(1, n_max + 1)
        want: list[int] = []
        for n in range(min(n_max, len(toks) - 1), n_min - 1, -1):
            starts = [i for i in range(len(toks) - n) if toks[i:i + n] == toks[len(toks) - n:]
                      and toks[i + n:i + n + k]]
            if starts:
                want = toks[starts[-1] + n:starts[-1] + n + k]
                break
        assert propose(toks, k, n_max, n_min) == want, (toks, k, n_max, n_min)


def test_accept_greedy_stops_at_the_first_disagreement():
    # targets[i] is the argmax after the last token (i = 0) and after draft token i
    assert accept_greedy([7, 8, 9], [7, 8, 9, 4]) == [7, 8, 9, 4]  # all accepted, plus one
    assert accept_greedy([7, 8, 9], [7, 5, 9, 4]) == [7, 5]  # 8 rejected: the target's 5 instead
    assert accept_greedy([7, 8, 9], [6, 8, 9, 4]) == [6]
    assert accept_greedy([], [3]) == [3]


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """The first emitted token follows the target p0 whatever the draft; given the first draft token was
    accepted, the second follows p1. Fresh random logits; 20,000 draws; total variation within sampling noise."""
    from engine.model.sampler import processed_probs

    torch.manual_seed(1)
    vocab, n = 8, 20_000
    logits = torch.randn(3, vocab) * 1.5
    probs = processed_probs(logits, params)
    gen = torch.Generator().manual_seed(2)
    d1 = int(torch.argsort(probs[0])[-2])  # a plausible but not the likeliest token
    d2 = int(torch.argsort(probs[1])[-1])
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        out = accept_sampled(logits, [d1, d2], params, gen)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if out[0] == d1:
            second[out[1]] += 1
    assert _tv(first, probs[0]) < 0.02, (first / n, probs[0])
    assert _tv(second, probs[1]) < 0.03, (second / second.sum(), probs[1])
    # a token the target rules out (top-k / top-p) is never emitted, even when drafted
    banned = probs[0] == 0
    assert first[banned].sum() == 0


def test_a_draft_of_a_token_the_target_excludes_is_always_rejected():
    logits = torch.tensor([[5.0, 0.0, -50.0], [0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = accept_sampled(logits, [2], SamplingParams(temperature=1.0, top_k=2), gen)
        assert out[0] != 2 and len(out) == 1


def test_draft_length_follows_acceptance_and_pauses_below_the_floor():
    s = SpecState(4)
    s.record(4, 4, max_k=6, floor=0.2, generated=5)
    assert s.k == 5  # all accepted: one longer
    s.record(5, 1, max_k=6, floor=0.2, generated=7)
    assert s.k == 2  # accepted one: one more than that
    assert s.paused_until < 0
    for g in range(10):
        s.record(2, 0, max_k=6, floor=0.2, generated=8 + g)
        if s.paused_until >= 0:
            break
    assert s.paused_until == 8 + g + PAUSE_TOKENS  # acceptance fell below the floor: a pause


def _scheduler(spec: VariantSpec, prompts: list[list[int]], outputs: list[list[int]]) -> Scheduler:
    """Running decodes with the given tokens (no model: the scheduler's drafts only)."""
    bm = BlockManager(64, 4, False)
    sched = Scheduler(spec, bm)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        seq = Sequence(f"r{i}", p, SamplingParams(max_tokens=50), i)
        seq.output_token_ids = list(o)
        bm.match_prefix(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
        assert bm.ensure_slots(seq, seq.num_tokens)
        sched.running.append(seq)
    return sched


def test_the_scheduler_drafts_within_budget_batch_limit_and_max_tokens():
    rep = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # "1 2 3" repeats: a draft of "4 5 6 ..."
    spec = VariantSpec(speculative_tokens=4, speculative_max_batch=2)
    out = _scheduler(spec, [rep, rep], [[], []]).schedule()
    assert [s.draft for s in out.scheduled] == [(4, 5, 6, 1), (4, 5, 6, 1)]
    assert [s.num_new_tokens for s in out.scheduled] == [5, 5]
    # three running > speculative_max_batch 2: nobody speculates
    out = _scheduler(spec, [rep] * 3, [[]] * 3).schedule()
    assert [s.draft for s in out.scheduled] == [(), (), ()]
    # a draft takes only budget the later rows can spare: every row still decodes
    tight = VariantSpec(speculative_tokens=4, speculative_max_batch=8, max_num_batched_tokens=4)
    out = _scheduler(tight, [rep, rep], [[], []]).schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [3, 1]
    assert out.num_batched_tokens == 4
    # no draft past max_tokens: one token left to generate means no room to speculate
    sched = _scheduler(spec, [rep], [[]])
    sched.running[0].params = SamplingParams(max_tokens=1)
    assert sched.schedule().scheduled[0].draft == ()
    # speculation off: no drafts
    assert _scheduler(VariantSpec(), [rep], [[]]).schedule().scheduled[0].draft == ()


def test_rejected_draft_blocks_go_back_to_the_pool():
    rep = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # 10 tokens, block size 4: 3 blocks hold them
    sched = _scheduler(VariantSpec(speculative_tokens=6), [rep], [[]])
    free = sched.block_manager.num_free_blocks
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.draft == (4, 5, 6, 7, 1, 2)
    assert sched.block_manager.num_free_blocks == free - 1  # 16 slots for the tokens and the draft: a 4th block
    sched.update(out, {"r0": [9]}, lambda s: None)  # the first draft token rejected: the target said 9
    seq = item.seq
    assert seq.output_token_ids == [9] and seq.num_computed_tokens == 10
    assert len(seq.block_table) == 3 and sched.block_manager.num_free_blocks == free


def test_variant_ids_recorded_before_speculation_stay_valid():
    # the static-best recorded for SmolLM2 on a CPU (engine/data/static_best.json) keeps its id
    assert VariantSpec(max_num_seqs=8, max_num_batched_tokens=512).variant_id == "652f4888b31f20db"
    assert VariantSpec(speculative_tokens=4).variant_id != VariantSpec().variant_id
    v = VariantSpec(speculative_tokens=4, prompt_lookup_max=4, speculative_min_acceptance=0.5)
    assert VariantSpec.from_json(v.to_json()) == v
    # the same behaviour, the same id: policy fields without speculation, 0 and 0.0
    assert VariantSpec(prompt_lookup_max=5).variant_id == VariantSpec().variant_id
    assert (VariantSpec(speculative_tokens=2, speculative_min_acceptance=0).variant_id
            == VariantSpec(speculative_tokens=2, speculative_min_acceptance=0.0).variant_id)


@pytest.mark.parametrize("bad", [{"speculative_tokens": -1}, {"prompt_lookup_min": 4, "prompt_lookup_max": 2},
                                 {"speculative_min_acceptance": 1.5}, {"speculative_max_batch": 0},
                                 {"speculative_tokens": True}])
def test_bad_speculation_fields_are_refused(bad):
    with pytest.raises(ConfigError):
        VariantSpec(**bad)


def test_a_draft_never_preempts_or_holds_back_a_running_sequence():
    """Blocks for drafts come from what the step leaves over: the one free block goes to the later row's decode,
    and the earlier row drafts only into its own last block's free slot."""
    bm = BlockManager(7, 4, False)
    sched = Scheduler(VariantSpec(speculative_tokens=4), bm)
    r0 = Sequence("r0", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4], SamplingParams(max_tokens=50), 0)  # "2 3 4" repeats
    r1 = Sequence("r1", [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13], SamplingParams(max_tokens=50), 1)
    for seq in (r0, r1):
        bm.match_prefix(seq)
        seq.num_computed_tokens = seq.num_tokens - 1
        assert bm.ensure_slots(seq, seq.num_tokens - 1)  # 3 blocks each; r1's next token needs a 4th
        sched.running.append(seq)
    assert bm.num_free_blocks == 1
    out = sched.schedule()
    assert not out.preempted and [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert out.scheduled[1].num_new_tokens == 1 and len(r1.block_table) == 4
    assert out.scheduled[0].draft == (5,) and len(r0.block_table) == 3  # one slot left in its last block
