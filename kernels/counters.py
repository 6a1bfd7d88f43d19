"""Arrival counters for kernels whose last program to finish does a reduction (split-KV merge, routing,
the experts' sum), and the float32 sums such a kernel accumulates into.

The kernels reset a counter (and a sum) once its last program has read it, so a buffer can serve every
layer of a step, and every step, without a zeroing launch (which would also sit between two kernels of a
CUDA graph that otherwise overlap under dependent launch).
"""
from __future__ import annotations

import torch


class ArrivalCounters:
    """Zeroed buffers (int32 counters, float32 sums) that the kernels reset after use: one buffer per device and
    dtype, owned by one operation instance (a variant's table), so launches of two variants (one warming up
    while the other serves) never share one. A larger request replaces the buffer; replaced buffers are kept,
    as CUDA graphs captured with them still use them."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._replaced: list[torch.Tensor] = []

    def __call__(self, n: int, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        buf = self._buffers.get((device, dtype))
        if buf is None or buf.numel() < n:
            if buf is not None:
                self._replaced.append(buf)
            buf = self._buffers[device, dtype] = torch.zeros(max(n, 256), device=device, dtype=dtype)
        return buf


def fresh_counters(n: int, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.zeros(n, device=device, dtype=dtype)
