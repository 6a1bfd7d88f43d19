"""Timing a kernel as a decode step runs it, and whether Triton runs on the CPU interpreter: shared by the Triton
operations that choose their tiles by measurement (kernels/linear/linear_triton.py, kernels/linear/qmma_triton.py)."""
from __future__ import annotations

import os

import torch


def interpreted() -> bool:
    """Whether Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_FLUSH: dict[torch.device, torch.Tensor] = {}


def graph_time(fn, calls: int = 10) -> float:
    """Milliseconds per call of ``fn`` with a cold L2 (as a decode step streams its weights), without the
    host's launch time: ``calls`` x (flush L2; fn) replayed from a CUDA graph, minus the flushes alone.
    (Timing launches one by one would charge a two-launch path for host time a graph does not spend.)"""
    dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=dev)  # 256 MB, more than L2
    buf = _FLUSH[dev]
    fn()
    torch.cuda.synchronize()
    both, flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(both, capture_error_mode="thread_local"):
        for _ in range(calls):
            buf.zero_()
            fn()
    with torch.cuda.graph(flush, capture_error_mode="thread_local"):
        for _ in range(calls):
            buf.zero_()

    def best(graph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(3):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return min(times)

    best(both), best(flush)  # first replays upload the graphs
    return max(0.0, best(both) - best(flush)) / calls
