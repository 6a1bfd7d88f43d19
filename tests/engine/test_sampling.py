"""Sampling: seeds, top-k, top-p, stop tokens and stop strings."""
from __future__ import annotations

import torch

from engine import SamplingParams
from engine.model.sampler import sample


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    top_k = [sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [gen])[0] for _ in range(300)]
    assert set(top_k) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # p0 = 0.64, p0 + p1 = 0.87
    top_p = [sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [gen])[0] for _ in range(300)]
    assert set(top_p) == {0, 1} and probs[0] < 0.8
    only = [sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [gen])[0] for _ in range(50)]
    assert set(only) == {0}
    # plain temperature sampling reaches the tail and follows the distribution
    draws = torch.tensor([sample(logits, [SamplingParams(temperature=1.0)], [gen])[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)


def test_greedy_rows_and_sampled_rows_in_one_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams()]
    out = sample(logits, params, [None, torch.Generator().manual_seed(1), None])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_seeded_sampling_is_reproducible_and_batch_independent(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=64)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = eng.generate(["Tell me a story about a dragon."], p)[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    batch = eng.generate(["Hi there", "Tell me a story about a dragon.", "Why is the sky blue?"],
                         [others[0], p, others[1]])
    assert batch[1].token_ids == alone
    other_seed = eng.generate(["Tell me a story about a dragon."],
                              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_stop_token_ids_and_stop_strings(smollm2_engine_factory):
    eng = smollm2_engine_factory(num_kv_blocks=64)
    full = eng.generate(["What is the capital of France?"], SamplingParams(max_tokens=16), chat=True)[0]
    assert full.text == "The capital of France is Paris." and full.finish_reason == "stop"
    stop_id = full.token_ids[3]
    cut = eng.generate(["What is the capital of France?"],
                       SamplingParams(max_tokens=16, stop_token_ids=(stop_id,)), chat=True)[0]
    assert cut.token_ids == full.token_ids[:4] and cut.finish_reason == "stop"
    s = eng.generate(["What is the capital of France?"], SamplingParams(max_tokens=16, stop=(" is",)), chat=True)[0]
    assert s.text == "The capital of France" and s.finish_reason == "stop"
    n = eng.generate(["What is the capital of France?"], SamplingParams(max_tokens=3), chat=True)[0]
    assert n.token_ids == full.token_ids[:3] and n.finish_reason == "length"


def test_penalties_and_biases_against_independent_references():
    """The repetition penalty against transformers' logits processor; presence and frequency penalties (OpenAI's
    definition) and logit biases against a float64 computation; on fresh random logits and histories."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from engine.model.sampler import adjust_logits, top_logprobs

    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        vocab = 50
        logits = torch.randn(vocab, generator=gen) * 3
        prompt = torch.randint(0, vocab, (12,), generator=gen).tolist()
        output = torch.randint(0, vocab, (9,), generator=gen).tolist()
        p = SamplingParams(repetition_penalty=1.7)
        ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[None].clone())[0]
        torch.testing.assert_close(adjust_logits(logits, p, prompt, output), ref)
        p = SamplingParams(presence_penalty=0.6, frequency_penalty=-0.3, logit_bias=((3, 7.5), (output[0], -2.0)))
        exp = logits.double().clone()
        for t in set(output):
            exp[t] -= 0.6 + (-0.3) * output.count(t)
        exp[3] += 7.5
        exp[output[0]] -= 2.0
        torch.testing.assert_close(adjust_logits(logits, p, prompt, output).double(), exp, rtol=0, atol=1e-5)
        assert p.adjusts_logits and p.per_token and not SamplingParams().per_token
        lp, top = top_logprobs(logits, 5, 3)
        ref_lp = logits.double() - torch.logsumexp(logits.double(), 0)
        assert abs(lp - ref_lp[5].item()) < 1e-5 and [t for t, _ in top] == ref_lp.topk(3).indices.tolist()
    # the greedy choice follows the adjusted logits: a bias decides it
    logits = torch.tensor([[5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(logit_bias=((1, 10.0),))], [None], [0], [([0], [])]) == [1]
    assert sample(logits, [SamplingParams()], [None], [0], [([0], [])]) == [0]
