"""Turning logits into tokens: greedy, or temperature / top-k / top-p with a per-request generator."""
from __future__ import annotations

import torch

from engine.config.sampling_params import SamplingParams


def adjust_logits(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row's logits ((vocab,) float32) after ``p``'s repetition penalty (over prompt and output), presence and
    frequency penalties (over the output) and logit biases; a new tensor."""
    x = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        x[ids.to(x.device)] -= (p.frequency_penalty * counts + p.presence_penalty * (counts > 0)).to(x)
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=x.device)
        x.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device))
    return x


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of ``token`` under one row's logits, and the ``k`` most likely tokens with theirs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, k) if k else None
    return float(lp[token]), ([] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))


def sample(
    logits: torch.Tensor,  # (N, vocab) float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    positions: list[int] | None = None,  # tokens generated so far per row (for forced tokens)
    histories: list[tuple[list[int], list[int]]] | None = None,  # per row (prompt, output), for adjusted logits
) -> list[int]:
    """One token per row. Greedy rows take the argmax; the others sample with their own generator,
    so a request's draw never depends on which requests share its batch. Rows with forced tokens
    emit the forced one (teacher forcing). Rows whose params adjust the logits (penalties, biases) choose
    from the adjusted ones."""
    if histories is not None and any(p.adjusts_logits for p in params):
        logits = torch.stack([adjust_logits(logits[i], p, *histories[i]) if p.adjusts_logits else logits[i]
                              for i, p in enumerate(params)])
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.forced_tokens and positions is not None and positions[i] < len(p.forced_tokens):
            tokens[i] = p.forced_tokens[positions[i]]
        elif not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    return tokens


def processed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution ``p`` samples from, per row of ``logits`` ((..., vocab) float32): temperature, then
    top-k, then top-p."""
    # the largest logit subtracted first: a tiny temperature then gives 0 for the best and -inf for the rest
    # (a draw of the argmax), never inf / inf
    x = (logits - logits.max(dim=-1, keepdim=True).values) / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p; the first always stays
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return torch.softmax(x, dim=-1)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(processed_probs(logits, p).cpu(), 1, generator=gen).item())
