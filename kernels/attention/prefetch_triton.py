"""Weights read into L2 ahead of the kernel that multiplies them, on a side stream.

In a decode step the attention's chain (q/k norms, rotary, KV store, attention, merge) moves
almost no bytes, and the output projection after it streams ~17-34 MB of weights from HBM.
``prefetch_triton`` starts a kernel on a second stream that reads those weights with the L2
"evict last" policy while the chain runs; the projection then reads them from L2. The
returned ``join`` makes the main stream wait for the reads (a CUDA graph capture must end with
every side stream joined); weights are never written during a step, so no other ordering is needed. With
``defer_join`` the projection does not wait for the reads at all (a cross-stream wait before a kernel may
cost it its dependent launch): the side stream is joined once, by the step's last call (site "end").

Same contract as ``kernels.attention.prefetch.prefetch_ref``.
"""
from __future__ import annotations

import functools
import inspect
import os
import threading
from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from kernels.attention.prefetch import SITES, no_join


@triton.jit
def _l2_prefetch_kernel(w_ptr, sink_ptr, N, PER_PROGRAM, BLOCK: tl.constexpr):
    """Reads elements [pid * PER_PROGRAM, +PER_PROGRAM) of w through L2 (kept there: evict last); the sum of
    what it read goes to sink[pid], so the reads are not optimized away."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * PER_PROGRAM
    end = tl.minimum(start + PER_PROGRAM, N)
    acc = tl.zeros([BLOCK], tl.float32)
    off = start
    while off < end:  # a while loop: the bound is known at run time (and the interpreter wants scalars)
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < end, other=0.0, eviction_policy="evict_last").to(tl.float32)
        off += BLOCK
    tl.store(sink_ptr + pid, tl.sum(acc, axis=0))


_SINK: dict[tuple[torch.device, int], torch.Tensor] = {}
_LOCAL = threading.local()  # per thread (a variant may warm up and capture its graphs beside a serving engine):
# .side, each device's side stream; .deferred, the devices whose side stream holds reads that no join of this
# thread's step has waited for yet


def _side(dev: torch.device) -> torch.cuda.Stream:
    """This thread's side stream on ``dev`` (a capture on one thread never takes in another thread's reads)."""
    if not hasattr(_LOCAL, "side"):
        _LOCAL.side = {}
    if dev not in _LOCAL.side:
        _LOCAL.side[dev] = torch.cuda.Stream(dev)
    return _LOCAL.side[dev]


def _deferred() -> set[torch.device]:
    if not hasattr(_LOCAL, "deferred"):
        _LOCAL.deferred = set()
    return _LOCAL.deferred


def _launch(w: torch.Tensor, sink: torch.Tensor, programs: int, block: int, num_warps: int) -> None:
    n = w.numel()
    per = -(-n // programs)
    per = -(-per // block) * block  # whole blocks per program
    _l2_prefetch_kernel[(programs,)](w, sink, n, per, BLOCK=block, num_warps=num_warps)


def prefetch_sums(w: torch.Tensor, programs: int = 4, block: int = 64) -> torch.Tensor:
    """The kernel run inline on ``w``: per-program sums of what it read (for tests: they add up to w's sum)."""
    sink = torch.zeros(programs, device=w.device, dtype=torch.float32)
    _launch(w.contiguous().view(-1), sink, programs, block, 4)
    return sink


def prefetch_triton(weights: Sequence[torch.Tensor | None], rows: int, site: str = "o_proj", *, max_rows: int = 4,
                    programs: int = 528, block: int = 4096, num_warps: int = 4, o_proj: int = 1,
                    next_qkv: int = 0, defer_join: int = 0) -> Callable[[], None]:
    """Starts reading ``weights`` into L2 on a side stream when the step multiplies them by at most ``max_rows``
    rows (decode: the weights' bytes are the kernel's time) and the call's ``site`` is switched on (``o_proj``:
    1 or 0; ``next_qkv``: 0 off, 1 at "next_qkv", 2 at "next_qkv_early"); returns ``join()``, which makes the
    current stream wait for those reads, or with ``defer_join`` (and always at "next_qkv_early") nothing: site
    "end" (no weights) returns the join of every deferred read; "abort" (a step that raised) forgets them (a later
    capture on this thread must not wait for work recorded outside it). On a CPU (or under the interpreter) nothing is
    started: no L2 to fill."""
    if site not in SITES:
        raise ValueError(f"unknown prefetch site {site!r}")
    if site == "end":
        return _join_deferred
    if site == "abort":
        return _deferred().clear
    ws = [w for w in weights if w is not None]
    on = {"o_proj": o_proj, "next_qkv": next_qkv == 1, "next_qkv_early": next_qkv == 2}[site]
    if not ws or rows > max_rows or not on or not ws[0].is_cuda or (
            os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")):
        return no_join
    dev = ws[0].device
    main = torch.cuda.current_stream(dev)
    side = _side(dev)
    if (dev, programs) not in _SINK:  # one per device, allocated once: the sums are never read
        _SINK[(dev, programs)] = torch.empty(programs, device=dev, dtype=torch.float32)
    sink = _SINK[(dev, programs)]
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for w in ws:
            assert w.is_contiguous(), "prefetch reads contiguous weights"
            _launch(w.view(-1), sink, programs, block, num_warps)

    if defer_join or site == "next_qkv_early":  # the early site's caller leaves its join to the step's end
        _deferred().add(dev)
        return no_join
    done = torch.cuda.Event()
    done.record(side)  # these reads only: a later site's reads queued behind them are not waited for

    def join() -> None:
        main.wait_event(done)

    return join


def make_prefetch(**params) -> Callable:
    """The prefetch callable for a variant: ``prefetch_triton`` with its parameters, checked when the variant is
    built (a misspelled or out-of-range one fails there, not in the first forward pass; ``ValueError`` or
    ``TypeError`` names it)."""
    known = {k: p.default for k, p in inspect.signature(prefetch_triton).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = set(params) - set(known)
    if unknown:
        raise TypeError(f"prefetch_triton: unknown parameters {', '.join(sorted(unknown))}")
    p = {**known, **params}
    for k in ("max_rows", "programs", "block", "num_warps"):
        if not isinstance(p[k], int) or isinstance(p[k], bool) or p[k] < 1:
            raise ValueError(f"prefetch {k} must be a positive integer, got {p[k]!r}")
    if p["block"] & (p["block"] - 1) or p["num_warps"] & (p["num_warps"] - 1):
        raise ValueError(f"prefetch block and num_warps must be powers of two, got {p['block']} and {p['num_warps']}")
    for k, choices in (("o_proj", (0, 1)), ("next_qkv", (0, 1, 2)), ("defer_join", (0, 1))):
        if p[k] not in choices or isinstance(p[k], bool):
            raise ValueError(f"prefetch {k} must be one of {', '.join(map(str, choices))}, got {p[k]!r}")
    return functools.partial(prefetch_triton, **params)


def _join_deferred() -> None:
    """The current streams wait for every side stream's deferred reads (this thread's)."""
    pending = _deferred()
    while pending:
        dev = pending.pop()
        torch.cuda.current_stream(dev).wait_stream(_side(dev))

