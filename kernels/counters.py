"""Arrival counters for kernels whose last program to finish does a reduction (split-KV merge, routing).

The kernels reset a counter once its last program has read it, so a buffer can serve every layer
of a step, and every step, without a zeroing launch (which would also sit between two kernels of a
CUDA graph that otherwise overlap under dependent launch).
"""
from __future__ import annotations

import torch


class ArrivalCounters:
    """Zeroed int32 counters that the kernels reset after use: one buffer per device, owned by one operation
    instance (a variant's table), so launches of two variants (one warming up while the other serves) never
    share one. A larger request replaces the buffer; replaced buffers are kept, as CUDA graphs captured with
    them still use them."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._replaced: list[torch.Tensor] = []

    def __call__(self, n: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < n:
            if buf is not None:
                self._replaced.append(buf)
            buf = self._buffers[device] = torch.zeros(max(n, 256), device=device, dtype=torch.int32)
        return buf


def fresh_counters(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, device=device, dtype=torch.int32)
