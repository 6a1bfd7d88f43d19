"""Prompt-lookup speculative decoding: drafts from the request's own tokens, verified in one forward pass.

A decoding sequence whose last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) occurred
earlier in its prompt or output proposes the tokens that followed that earlier occurrence (the most recent one)
as a draft. The step runs the sequence's last token and the draft together, like a short prefill chunk over its
paged KV, and reads logits at every position. The draft's tokens are accepted while they agree with the target:
greedy rows compare with the argmax; sampled rows use rejection sampling, which keeps the target distribution
exactly (a draft token d, proposed with probability 1, is kept with probability p(d); on a rejection the token
is drawn from p with d removed). Every step emits the accepted tokens plus one token of the target's own, so a
row emits 1..k+1 tokens. KV written for rejected positions lies beyond the sequence's computed length: it is
never read, the next step overwrites it, and whole blocks holding only rejected positions go back to the pool.

Adaptive, per request and per batch (the policy's parameters are VariantSpec fields the tuner searches):
- a request's draft length follows its acceptance: all accepted -> one longer (up to ``speculative_tokens``),
  a rejection -> the accepted count plus one;
- a request whose running acceptance rate falls below ``speculative_min_acceptance`` stops speculating for
  ``PAUSE_TOKENS`` tokens, then tries again;
- no row speculates when more than ``speculative_max_batch`` sequences run: verification then costs more
  compute than the saved steps are worth.
"""
from __future__ import annotations

import torch

from engine.model.sampler import processed_probs
from engine.config.sampling_params import SamplingParams

PAUSE_TOKENS = 32  # tokens a request decodes without drafts after its acceptance fell below the floor
EMA = 0.3  # weight of the latest verification in a request's running acceptance rate


def propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier occurrence of the longest suffix n-gram
    (``n_max`` >= n >= ``n_min``) of ``tokens``; [] when none occurs."""
    size = len(tokens)
    if k < 1:
        return []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        # most recent first; a match ends before the suffix itself, so at least one token follows it
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == suffix[0] and tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class SpecState:
    """A request's speculation state: its current draft length and running acceptance."""

    __slots__ = ("k", "acceptance", "paused_until")

    def __init__(self, k: int) -> None:
        self.k = k
        self.acceptance = 1.0
        self.paused_until = -1  # output length before which the request does not speculate

    def record(self, proposed: int, accepted: int, max_k: int, floor: float, generated: int) -> None:
        self.acceptance = (1 - EMA) * self.acceptance + EMA * accepted / proposed
        self.k = min(max_k, self.k + 1) if accepted == proposed else max(1, accepted + 1)
        if self.acceptance < floor:
            self.paused_until = generated + PAUSE_TOKENS
            self.acceptance = (1 + floor) / 2  # a fresh chance after the pause, not a verdict carried forever
            self.k = max(1, max_k // 2)


def draft_for(seq, spec, running: int, room: int) -> list[int]:
    """The draft for a decoding ``seq`` under variant ``spec`` with ``running`` sequences in the batch and
    ``room`` tokens to spare (budget, context, max_tokens); [] when it should not speculate."""
    k = spec.speculative_tokens
    if k < 1 or room < 1 or running > spec.speculative_max_batch or seq.params.forced_tokens or seq.params.per_token:
        return []
    state = seq.spec
    if state is None:
        state = seq.spec = SpecState(k)
    if len(seq.output_token_ids) < state.paused_until:
        return []
    want = min(state.k, k, room)
    return propose(seq.token_ids, want, spec.prompt_lookup_max, spec.prompt_lookup_min)


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """Tokens a greedy row emits: ``targets`` (the argmax after the last token and after each draft token)
    up to and including the first one where the draft disagrees."""
    out = [targets[0]]
    for d, t in zip(draft, targets[1:]):
        if d != out[-1]:
            break
        out.append(t)
    return out


def accept_sampled(logits: torch.Tensor, draft: list[int], params: SamplingParams,
                   gen: torch.Generator | None) -> list[int]:
    """Rejection sampling of a point-mass draft against ``logits`` ((len(draft) + 1, vocab) float32): the
    emitted tokens are distributed exactly as sampling from the target one token at a time."""
    probs = processed_probs(logits, params).cpu()
    out: list[int] = []
    for i, d in enumerate(draft):
        p = probs[i]
        u = torch.rand((), generator=gen).item()
        if u < p[d].item():
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = residual.sum()
        if total <= 0:  # p was a point mass on d: a rejection cannot happen; kept for safety
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=gen).item()))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=gen).item()))
    return out
