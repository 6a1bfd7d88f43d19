"""Programmatic dependent launch (Hopper and later) for the decode kernels.

A kernel launched with it may be scheduled while the kernel before it in the stream is still
running: a decode step is ~500 launches of a few microseconds each, and without it every one
of them pays the gap between one kernel's last block and the next kernel's first. A kernel that
takes part calls ``pdl_enter`` before it reads or writes anything an earlier kernel may touch
(``griddepcontrol.wait`` returns once the kernel before has finished and its writes are
visible), and lets the kernel after it be scheduled from then on. Weights are never written
during a step, so a matrix-vector kernel requests its first chunk of them before the wait.

Each Triton operation takes ``pdl`` (0: off; 1: wait, then let the next kernel be scheduled; 2: the
other way round) as a kernel parameter; it has an effect only on a CUDA device of compute
capability 9 or more, and never under the CPU interpreter.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """PDL 1: waits for the kernel before (its writes are visible afterwards), then lets the next one be
    scheduled; 2: lets the next one be scheduled first, then waits (two kernels ahead can be resident and
    requesting their weights). No kernel is scheduled before all blocks of the one before it were."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(pdl: int, x: torch.Tensor) -> dict:
    """The ``PDL`` constexpr (0, 1 or 2, as ``pdl_enter``) and the launch option for a kernel whose operands
    live on ``x``'s device."""
    if pdl not in (0, 1, 2):
        raise ValueError(f"pdl must be 0, 1 or 2, got {pdl!r}")
    on = bool(pdl) and x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and _supported(
        x.device.index if x.device.index is not None else torch.cuda.current_device())
    return {"PDL": int(pdl), "launch_pdl": True} if on else {"PDL": 0}
