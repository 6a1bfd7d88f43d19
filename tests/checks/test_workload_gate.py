"""The workload gate: an exact variant passes bit-exact mode, a precision variant (bf16 autocast) fails it and
passes the documented tolerance mode, tolerances too tight fail, and a failure names its input."""
from __future__ import annotations

import pytest
import torch

from checks.workload_gate import BIT_EXACT, TOLERANCE, Tolerance, gate_workload, reference_for
from engine.workloads import WorkloadVariant, get_workload


@pytest.fixture(scope="module")
def patchtst():
    w = get_workload("patchtst")
    return w, w.build()


def test_batched_variant_passes_bit_exact_on_fresh_inputs(patchtst):
    w, module = patchtst
    r = gate_workload(w, WorkloadVariant(max_batch=8, bucket_sizes=(4, 8)), module, "cpu")
    assert r.passed and r.mode == BIT_EXACT and r.max_abs == 0.0 and r.failed_input is None
    assert r.checked == 2 * (1 + 3 + 8)


def test_fno_batches_pass_bit_exact():
    w = get_workload("fno")
    r = gate_workload(w, WorkloadVariant(max_batch=4), w.build(), "cpu", batch_sizes=(3, 5), rounds=1)
    assert r.passed, r.line()


def test_bf16_fails_bit_exact_and_passes_tolerance(patchtst):
    w, module = patchtst
    bf16 = WorkloadVariant(max_batch=8, matmul_precision="bf16")
    exact = gate_workload(w, bf16, module, "cpu", mode=BIT_EXACT, seed=11)
    assert not exact.passed and exact.max_abs > 0
    assert exact.failed_input.startswith("round 0, batch of 1") and "seed" in exact.failed_input
    default = gate_workload(w, bf16, module, "cpu", seed=11)  # a precision variant's own mode
    assert default.mode == TOLERANCE and default.passed, default.line()
    assert default.max_rel <= Tolerance().max_rel
    tight = gate_workload(w, bf16, module, "cpu", tolerance=Tolerance(max_abs=1e-7, max_rel=1e-7), seed=11)
    assert not tight.passed and "FAILED" in tight.line()


def test_the_seed_reproduces_the_inputs(patchtst):
    w, module = patchtst
    bf16 = WorkloadVariant(matmul_precision="bf16")
    a = gate_workload(w, bf16, module, "cpu", seed=5, rounds=1, batch_sizes=(2,))
    b = gate_workload(w, bf16, module, "cpu", seed=5, rounds=1, batch_sizes=(2,))
    assert (a.max_abs, a.max_rel) == (b.max_abs, b.max_rel)


def test_bad_gate_arguments_are_refused(patchtst):
    w, module = patchtst
    with pytest.raises(ValueError, match="gate mode"):
        gate_workload(w, WorkloadVariant(), module, "cpu", mode="close-enough")
    with pytest.raises(ValueError, match="batch_sizes"):
        gate_workload(w, WorkloadVariant(), module, "cpu", batch_sizes=())
    with pytest.raises(ValueError, match="non-negative"):
        Tolerance(max_abs=-1)


class _BatchVariant(torch.nn.Module):
    """The model with an output that moves with the batch's size, as a GPU's batched kernels move the last bits."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **inputs):
        y = self.inner(**inputs)
        return y + 1e-3 * (next(iter(inputs.values())).shape[0] - 1)


def test_the_reference_runs_in_the_variants_batches_and_batch_variance_is_reported_apart(patchtst):
    w, module = patchtst
    variant = WorkloadVariant(max_batch=4, bucket_sizes=(2, 4))
    assert reference_for(variant).max_batch == 4 and reference_for(variant).bucket_sizes == (2, 4)
    assert reference_for(variant).deterministic and reference_for(variant).compile_mode is None
    r = gate_workload(w, variant, _BatchVariant(module), "cpu", batch_sizes=(1, 3), rounds=1, seed=3)
    # the variant's forward is the reference's: bit-exact, though its batches differ from one request at a time
    assert r.passed and r.max_abs == 0.0, r.line()
    assert r.batch_max_abs >= 1e-3  # a bucket of 4 against batches of 1: a larger leading axis
    exact = gate_workload(w, variant, module, "cpu", batch_sizes=(3,), rounds=1, seed=3)
    assert exact.passed and exact.batch_max_abs == 0.0  # the CPU's batched kernels equal its batch-1 ones here
