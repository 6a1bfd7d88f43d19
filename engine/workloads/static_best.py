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
  workload's middle size, no traffic); before that sweep, the batch policy's library-typical ``max_batch``. Found
  once per device: a sweep can be recorded (``record``, in engine/data/workload_static_best.json, with its
  figures) and a later tuning takes it from there (``lookup``) instead of compiling every batch again (minutes
  for e3nn and torch-geometric on a GPU); a GPU without its own entry takes another GPU's, named so.
- no CUDA graphs and no batch buckets: both need to know which shapes come, which is traffic.
"""
from __future__ import annotations

import os
from datetime import date
from pathlib import Path

import torch

from engine.config.static_best import device_label, read_entries, write_entries
from engine.workloads.variants import WorkloadVariant
from engine.workloads.workload import Workload


def static_best(workload: Workload, device: str | torch.device, max_batch: int | None = None,
                compile: bool | None = None) -> WorkloadVariant:
    """The static-best variant of ``workload`` on ``device`` (module docstring). ``max_batch``: the swept best
    fixed batch (default: the policy's); ``compile``: force compile on or off (default: on a CUDA device)."""
    use_compile = torch.device(device).type == "cuda" if compile is None else compile
    return WorkloadVariant(name="static-best", compile_mode="default" if use_compile else None,
                           max_batch=max_batch or workload.batch.max_batch)


PATH = Path(__file__).resolve().parents[1] / "data" / "workload_static_best.json"


def _path() -> Path:
    return Path(os.environ.get("POLYINF_WORKLOAD_STATIC_BEST", PATH))


def _entries() -> list[dict]:
    return read_entries(_path())


def lookup(workload: str, device: str | torch.device) -> dict | None:
    """The recorded sweep of ``workload`` on this kind of device (``engine.config.static_best.device_label``):
    {"workload", "device", "max_batch", "compile", "batches", "throughput", "date", "torch"}; on a GPU without an
    entry of its own, another GPU's (its "device" names it); None when nothing is recorded."""
    label = device_label(str(device))
    found = [e for e in _entries() if e["workload"] == workload]
    own = [e for e in found if e["device"] == label]
    other = [e for e in found if e["device"] != "cpu"] if label != "cpu" else []
    return (own or other or [None])[0]


def record(workload: str, device: str | torch.device, max_batch: int, compile: bool,
           throughput: dict[int, float], batches: list[int] | None = None) -> Path:
    """Records (or replaces) ``workload``'s static-best on this kind of device: the swept batch, whether it is
    compiled, the batches the sweep covered (``batches``, default those measured) and its figures (requests/s
    per fixed batch). A tuning takes the entry only where it covers the batches that tuning would sweep."""
    label = device_label(str(device))
    kept = [e for e in _entries() if (e["workload"], e["device"]) != (workload, label)]
    kept.append({"workload": workload, "device": label, "max_batch": int(max_batch), "compile": bool(compile),
                 "batches": sorted(int(b) for b in (batches or throughput)),
                 "throughput": {str(b): round(r, 1) for b, r in sorted(throughput.items())},
                 "date": date.today().isoformat(), "torch": torch.__version__})
    return write_entries(_path(), kept, key=lambda e: (e["workload"], e["device"]))
