"""The gate of a workload variant: its outputs against the reference's on fresh random inputs.

The **reference** is the same module run eagerly in IEEE float32 with torch's deterministic algorithms, in the
variant's own batches (its batch size and buckets: the same groups, the same padding). What the gate judges is
the variant's forward (compiled code, graphs, kernels, layout, precision) against plain eager on the same inputs.
How batching itself moves the last bits is the library's batch variance, the same for every form at that batch:
on a GPU, cuBLAS picks other kernels for other row counts (an H200: PatchTST's outputs at batch 16 differ from
batch 1's by 1.9e-6), so no batched form, static-best included, could equal a batch-1 reference; the gate
reports that figure apart (``batch_max_abs``: the reference in the variant's batches against the reference one
request at a time). Every check draws new requests (sizes from the workload's levels, mixed within a batch so the
batch policy's grouping is exercised) from a seed it records, and runs them in batches of several sizes.

- **bit-exact** (the default): every output equals the reference's bit for bit (``torch.equal``). A variant that
  claims nothing about precision must pass this; batching, layouts, compile modes and graphs that reorder a
  floating-point sum fail it.
- **tolerance** (for variants that change precision on purpose, ``WorkloadVariant.needs_tolerance``): a request
  passes when its max abs error is at most ``max_abs + max_rel * max|ref|`` (allclose's atol + rtol, with the
  reference's largest magnitude as the scale, so the bound stays finite where the reference crosses zero and
  follows each model's output scale). The defaults (1e-3 abs, 3% of the scale) sit above what bfloat16 autocast
  costs these four models (1.1% of the scale at most, measured on the CPU) and far below what a broken kernel
  gives (order 1).
"""
from __future__ import annotations

import os
import random
import dataclasses
from dataclasses import asdict, dataclass

import torch

from engine.workloads.variants import WorkloadVariant, build_runner
from engine.workloads.workload import Workload

BIT_EXACT, TOLERANCE = "bit-exact", "tolerance"
# deterministic: a CUDA scatter-add (the GNN's and the protein network's message sums) otherwise sums by atomics
# in a different order on every run, and no output could equal it bit for bit, not even its own
REFERENCE = WorkloadVariant(name="reference", max_batch=1, deterministic=True)


def reference_for(variant: WorkloadVariant) -> WorkloadVariant:
    """The reference in ``variant``'s batches: eager, IEEE float32, deterministic, its batch size and buckets."""
    return dataclasses.replace(REFERENCE, max_batch=variant.max_batch, bucket_sizes=variant.bucket_sizes)


@dataclass(frozen=True)
class Tolerance:
    max_abs: float = 1e-3
    max_rel: float = 0.03

    def __post_init__(self) -> None:
        if not (self.max_abs >= 0 and self.max_rel >= 0):
            raise ValueError(f"tolerances must be non-negative, got {self}")


@dataclass(frozen=True)
class GateResult:
    passed: bool
    mode: str  # "bit-exact" | "tolerance"
    max_abs: float  # over every request checked
    max_rel: float  # max|out - ref| / max|ref|, over every request checked
    checked: int  # requests compared
    seed: int  # the inputs' seed: ``gate_workload(..., seed=seed)`` draws them again
    failed_input: str | None = None  # the first request that failed: batch, its sizes, which one
    variant_id: str = ""
    batch_max_abs: float = 0.0  # the reference in the variant's batches against it one request at a time


    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        what = "passed" if self.passed else f"FAILED at {self.failed_input}"
        return (f"{self.mode} gate {what}: {self.checked} requests, max abs error {self.max_abs:.3g}, "
                f"relative {self.max_rel:.3g} (seed {self.seed})")


def gate_workload(workload: Workload, variant: WorkloadVariant, module: torch.nn.Module,
                  device: str | torch.device, mode: str | None = None, batch_sizes: tuple[int, ...] = (1, 3, 8),
                  rounds: int = 2, seed: int | None = None, tolerance: Tolerance = Tolerance()) -> GateResult:
    """``variant`` over ``module`` against the reference on ``rounds`` draws of fresh requests for every batch size
    in ``batch_sizes``. ``mode``: "bit-exact" or "tolerance"; by default tolerance for a variant that changes
    precision on purpose, bit-exact for every other. ``seed``: the inputs' seed (default: a fresh one)."""
    mode = mode or (TOLERANCE if variant.needs_tolerance else BIT_EXACT)
    if mode not in (BIT_EXACT, TOLERANCE):
        raise ValueError(f"gate mode must be {BIT_EXACT!r} or {TOLERANCE!r}, got {mode!r}")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = random.Random(seed)
    reference = build_runner(workload, reference_for(variant), module, device)
    one_by_one = build_runner(workload, REFERENCE, module, device)
    runner = build_runner(workload, variant, module, device)
    worst_abs = worst_rel = batch_abs = 0.0
    checked, failed = 0, None
    for r in range(rounds):
        for n in batch_sizes:
            sizes = [rng.choice(workload.size_levels) for _ in range(n)]
            draw = rng.randrange(2**31)
            requests = workload.make_inputs(sizes, draw, device)
            ref, out = reference(requests), runner(requests)
            batch_abs = max([batch_abs] + [(a - b).abs().max().item() for a, b in zip(ref, one_by_one(requests))
                                           if a.shape == b.shape and a.numel()])
            for i, (a, b) in enumerate(zip(out, ref)):
                checked += 1
                a = a.float()
                if a.shape != b.shape:
                    err = rel = float("inf")
                else:
                    err = (a - b).abs().max().item()
                    rel = err / max(b.abs().max().item(), 1e-30)
                worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
                scale = b.abs().max().item() if b.numel() else 0.0
                ok = torch.equal(a, b) if mode == BIT_EXACT else err <= tolerance.max_abs + tolerance.max_rel * scale
                if not ok and failed is None:
                    failed = (f"round {r}, batch of {n} (sizes {sizes}, inputs seed {draw}), request {i} "
                              f"(size {sizes[i]})")
    return GateResult(failed is None, mode, worst_abs, worst_rel, checked, seed, failed, variant.variant_id,
                      batch_abs)
