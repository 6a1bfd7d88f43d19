"""Static-best for a workload: the libraries' recommended fast setup, fixed once without seeing any traffic.

- **compile**: on a CUDA device, ``torch.compile`` in its default mode, the setup PyTorch, torch-geometric and e3nn
  recommend for inference speed, with the library's default ``dynamic`` (automatic dynamic shapes: a dimension is
  specialised until a second value of it comes, then compiled as symbolic; ``dynamic=False`` would compile every
  batch and resolution anew, ``dynamic=True`` gives up the specialised first graph). On a CPU, eager: Inductor's
  CPU backend writes no code for complex operators (the FNO's spectral weights run as eager fallbacks), every new
  request shape costs a compile of tens of seconds on a small CPU, and none of the libraries names it their CPU
  inference setup; a compiled form stays a candidate the tuner measures there (where a C++ compiler is on the
  PATH). Where compiling fails on a device, the tuner falls back to eager static-best and says so.
- **dtype and layout**: the model's own float32 with IEEE matmuls and the default (contiguous) layout: none of the
  four libraries recommends a lower precision for inference of these models, and a precision change is the
  tolerance gate's to allow, not a default's.
- **batch**: the best fixed batch, found by ``ops.workloads.tune.find_static_best`` on a fixed synthetic load (the
  workload's middle size, no traffic); before that sweep, the batch policy's library-typical ``max_batch``.
- no CUDA graphs and no batch buckets: both need to know which shapes come, which is traffic.
"""
from __future__ import annotations

import torch

from engine.workloads.variants import WorkloadVariant
from engine.workloads.workload import Workload


def static_best(workload: Workload, device: str | torch.device, max_batch: int | None = None,
                compile: bool | None = None) -> WorkloadVariant:
    """The static-best variant of ``workload`` on ``device`` (module docstring). ``max_batch``: the swept best
    fixed batch (default: the policy's); ``compile``: force compile on or off (default: on a CUDA device)."""
    use_compile = torch.device(device).type == "cuda" if compile is None else compile
    return WorkloadVariant(name="static-best", compile_mode="default" if use_compile else None,
                           max_batch=max_batch or workload.batch.max_batch)
