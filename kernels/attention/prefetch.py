"""Prefetch: start reading weights that a later kernel of the step will multiply (a hint; no result).

``prefetch(weights, rows, site)`` returns ``join()``; the forward pass calls it before the kernel that reads the
weights, and at the end of the step calls ``prefetch((), rows, "end")()``: the join of every read whose own join
was deferred (``"abort"`` instead when the step raised). The reference starts nothing; the Triton form
(``kernels.attention.prefetch_triton``) reads them into L2 on a side stream while the step's latency-bound kernels run.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


SITES = ("o_proj", "next_qkv_early", "next_qkv", "end", "abort")


def no_join() -> None:
    """The join of a prefetch that started nothing."""


def prefetch_ref(weights: Sequence[torch.Tensor | None], rows: int, site: str = "o_proj") -> Callable[[], None]:
    """weights: tensors a later kernel reads (None entries are skipped), with ``rows`` rows of input; ``site``:
    which call of the forward pass this is ("o_proj": the attention's output projection, during the attention;
    "next_qkv_early": the next layer's QKV projection, during the attention after the output projection's;
    "next_qkv": the same, during this layer's MLP; "end": no weights, the step's last call; "abort": no weights,
    called when the step raised). Returns join(), to be called before that kernel (for "end": before the step's
    result is used; for "abort": it forgets the step's deferred reads without waiting for them)."""
    if site not in SITES:
        raise ValueError(f"unknown prefetch site {site!r}")
    return no_join
